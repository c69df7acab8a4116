"""Prompt-only records of a continual job with `regenerate` settings: the target answers them
first (the regeneration decoder, regenerate/decode.py: SlotDecoder), and the conversation with its answer is
what the drafter trains on, so that it learns what the current target says.

The decoder and its cache are allocated once, when the job starts (`slots` sequences of the
engine's generation length), and used between training steps from the job's thread: answering
shares the devices with training, and the seconds each takes are reported (`regenerate` events).
Each prompt's seed is fixed by the job's seed and the prompt's arrival number, so sampling does
not depend on batching.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..data.conversations import Conversation
from ..data.tokenize import ChatTemplate
from ..engine.api import JobError
from ..engine.config import job_template
from ..engine.context import RunContext
from ..regenerate.decode import Request, Sampling, SlotDecoder
from ..regenerate.job import row_seed
from ..regenerate.run import generation_length
from .job import ContinualJob

REPORT_SECONDS = 5.0  # how often the split of time between answering and training is reported


@dataclass(frozen=True)
class AnswerSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    slots: int = 8  # prompts answered at once

    @classmethod
    def of(cls, values: dict[str, Any]) -> AnswerSettings:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass
class Prompt:
    messages: list[dict[str, str]]
    source: str
    seq: int  # arrival number (the seed's part)


class Answerer:
    def __init__(
        self, target: Any, tokenizer: Any, template: ChatTemplate, settings: AnswerSettings, length: int, stops: tuple
    ):
        self.tokenizer, self.template, self.settings, self.length = tokenizer, template, settings, length
        # no stacked q/k/v copy: beside a training job its memory (a copy of those weights) buys
        # little at a few slots, where a step's GEMMs are bound by the weights' bytes, not launches
        self.decoder = SlotDecoder(target.model, max(1, settings.slots), length, stacked_qkv=False)
        self.sampling = Sampling(settings.temperature, settings.top_p, settings.top_k, tuple(stops))
        self.waiting: collections.deque[Prompt] = collections.deque()
        self.lock = threading.Lock()  # the ingest thread adds, the job's thread answers
        self.arrived = 0
        self.answered = 0
        self.answered_through = 0  # the arrival number of the newest prompt answered (or skipped)
        self.seconds = 0.0  # spent answering since the last report
        self.tokens = 0
        self._reported = 0.0  # the first answers are reported at once

    def add(self, messages: list[dict[str, str]], source: str) -> None:
        with self.lock:
            self.arrived += 1
            self.waiting.append(Prompt(messages, source, self.arrived))

    @property
    def pending(self) -> int:
        return len(self.waiting)

    def answer(self, turn: Callable[[], AbstractContextManager]) -> tuple[list[Conversation], list[str]]:
        """Answer up to `slots` waiting prompts: their conversations, and why any was skipped
        (a prompt that leaves no room for an answer). The tokenizer is used only inside `turn()`
        (the feed's turns at it), so the ingest thread tokenizes while the target decodes."""
        with self.lock:
            batch = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.decoder.slots))]
        if not batch:
            return [], []
        began = time.monotonic()
        requests, skipped = [], []
        with turn():
            for i, prompt in enumerate(batch):
                text = self.template.render(self.tokenizer, prompt.messages, True)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(ids) >= self.length:
                    skipped.append(
                        f"{prompt.source}: the prompt has {len(ids)} tokens; the generation length is {self.length}"
                    )
                    continue
                seed = row_seed(self.settings.seed, prompt.seq, 0)
                requests.append(Request(i, ids, self.settings.max_new_tokens, seed))
        out: list[Conversation] = []
        try:
            for completion in self.decoder.generate(requests, self.sampling):
                prompt = batch[int(completion.key)]  # type: ignore[call-overload]
                tokens = completion.tokens
                if completion.finish_reason == "stop" and tokens and tokens[-1] in self.sampling.stop_token_ids:
                    tokens = tokens[:-1]
                with turn():
                    answer = {"role": "assistant", "content": self.tokenizer.decode(tokens)}
                out.append(Conversation([*prompt.messages, answer], prompt.source))
                self.tokens += len(completion.tokens)
        except BaseException:
            with self.lock:  # not answered: back first in line, never counted as answered
                self.waiting.extendleft(reversed(batch))
            raise
        self.answered_through = batch[-1].seq  # answered in arrival order: every prompt up to it
        self.answered += len(out)
        self.seconds += time.monotonic() - began
        return out, skipped

    def report(self, train_seconds: float, force: bool = False) -> dict[str, Any] | None:
        """The split of time since the last report (answering, training), every few seconds."""
        now = time.monotonic()
        if not force and now - self._reported < REPORT_SECONDS:
            return None
        if not self.seconds and not force:
            return None
        report = {
            "answered": self.answered,
            "waiting": self.pending,
            "tokens": self.tokens,
            "answer_seconds": round(self.seconds, 3),
            "train_seconds": round(train_seconds, 3),
        }
        self.seconds, self.tokens, self._reported = 0.0, 0, now
        return report


def check_answering(context: RunContext, job: ContinualJob) -> None:
    """JobError naming the field when this engine cannot answer the job's prompts."""
    assert job.regenerate is not None
    settings = AnswerSettings.of(job.regenerate)
    if context.parts is None:
        length = context.config.generate_max_len or context.config.seq_len
    else:
        if len(context.parts.targets[0].stages) > 1:
            raise JobError("answering prompts needs a target on one device (this one is split)", "regenerate")
        length = generation_length(context)
    if settings.max_new_tokens > length - 1:
        raise JobError(
            f"{settings.max_new_tokens} is beyond the engine's generation length of {length} positions",
            "regenerate.max_new_tokens",
        )


def answerer_for(context: RunContext, job: ContinualJob) -> Answerer:
    """The job's answerer on the engine's first target copy, its decoder allocated now."""
    assert job.regenerate is not None
    tokenizer, target = context.built.tokenizer, context.built.targets[0]
    eos = getattr(target.model.generation_config, "eos_token_id", None)
    stops: set[int] = {int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else [])}
    if (eos_id := getattr(tokenizer, "eos_token_id", None)) is not None:
        stops.add(int(eos_id))
    settings = AnswerSettings.of(job.regenerate)
    return Answerer(target, tokenizer, job_template(job), settings, generation_length(context), tuple(sorted(stops)))
