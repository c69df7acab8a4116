"""The regeneration run: the engine's warm target answers every prompt of the job's datasets
(`samples_per_prompt` times each), decoded by decode.SlotDecoder, and the answers are written
as parquet shards of conversations with a manifest (output.py).

The work is fixed before anything is generated: the prompts in reading order, each (prompt,
sample) a row, the rows sorted by prompt length (longest first: slots prefilled together have
similar lengths, and a prompt too large for the device fails the first shard, not the last) and
cut into shards of `shard_rows`. The plan (sources and their hashes, target, template, sampling,
counts) is in the manifest; a run that finds its own plan there skips the shards already written.
The output names every path (a dataset, a row's source, the target) relative to the output
directory, never as the host's absolute path: the output can be moved or shared with the paths
meaning the same relative to it.

The decode shapes (slots, cache positions per sequence) are engine settings; unset, the slots
follow from the memory the device has left when the job starts (after the drafters), and the
cache is allocated for the job and given back at its end, so that training jobs keep the memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..confine import OutsideRoots, open_regular, resolved_under
from ..data.conversations import DatasetError, ReadReport
from ..data.prompts import read_prompts
from ..data.regenerated import MANIFEST
from ..data.sources import dataset_files
from ..engine.api import JobCallbacks, JobError, JobResult
from ..engine.config import job_template
from ..engine.context import RunContext
from ..engine.failures import readable_failures
from ..target_identity import config_sha256, target_identity
from .decode import Request, Sampling, SlotDecoder
from .job import RegenerateJob, row_seed
from .output import ShardOutput
from .sizing import decoder_bytes, kv_bytes_per_token, slots_for_memory

log = logging.getLogger("dflash.regenerate")
PROGRESS_SECONDS = 2.0  # how often a regeneration reports its progress
CPU_SLOTS = 8


def generation_length(context: RunContext) -> int:
    """Cache positions per sequence: the setting, else the training context (seq_len), within
    the target's own position limit."""
    cfg = context.config
    length = cfg.generate_max_len or cfg.seq_len
    limit = getattr(context.targets[0].config, "max_position_embeddings", None) if context.targets else None
    return min(length, int(limit)) if limit else length


def generation_slots(context: RunContext, length: int) -> int:
    """The setting, else from the memory the target's device has free now (CUDA), else a few."""
    if context.config.generate_slots:
        return context.config.generate_slots
    target = context.targets[0]
    if target.device.type != "cuda":
        return CPU_SLOTS
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(target.device)
    free -= decoder_bytes(target.model)
    return slots_for_memory(free, kv_bytes_per_token(target.config, target.dtype), length)


class RegenerationRun:
    """A regeneration job on the built engine (the run protocol of engine/kinds.py)."""

    def __init__(self, context: RunContext, job: RegenerateJob, callbacks: JobCallbacks, resume_from: str | None):
        """resume_from is not read: the output directory's manifest says what is done."""
        self.context, self.job, self.cb = context, job, callbacks

    @classmethod
    def validate(cls, context: RunContext, job: RegenerateJob) -> None:
        """Raise JobError(message, field) for a job this engine cannot run."""
        cls(context, job, JobCallbacks(), None).check(job)

    def admit(self) -> None:
        """Nothing to hand to other processes (one host); execute() checks the job again."""

    # ------------------------------------------------------------------ validation
    def check(self, job: RegenerateJob) -> None:
        context = self.context  # one host only: the kinds table says so, and run_class enforces it
        if context.parts is None:
            length = context.config.generate_max_len or context.config.seq_len
        else:
            if len(context.targets[0].stages) > 1:
                raise JobError("regeneration needs a target on one device (this one is split over several)", "kind")
            length = generation_length(context)
        if job.max_new_tokens > length - 1:
            raise JobError(
                f"{job.max_new_tokens} is beyond the engine's generation length of {length} positions (prompt plus "
                "new tokens; [engine] generate_max_len)",
                "max_new_tokens",
            )
        if context.parts is not None:
            self._check_template(job)
            self._check_first_prompts(job, length)

    def _check_first_prompts(self, job: RegenerateJob, length: int) -> None:
        """The first prompt of each dataset fits the generation length, so that a dataset of prompts
        too long is refused at submission; a later one fails the job naming its place (or is
        skipped with skip_bad_lines). What cannot be read is the dataset check's to report."""
        if job.skip_bad_lines:
            return
        tokenizer = self.context.tokenizer
        template = job_template(job)  # type: ignore[arg-type]
        for i, entry in enumerate(job.datasets):
            try:
                path = resolved_under(entry, job.dataset_roots, "dataset")
                first = next(read_prompts(path, roots=job.dataset_roots), None)
            except (OutsideRoots, DatasetError, OSError):
                continue
            if first is None:
                continue
            try:
                text = template.probe(tokenizer, first.messages, True)
            except Exception as e:  # noqa: BLE001 - any template failure is the user's to fix
                raise JobError(
                    f"the chat template cannot render its first prompt: {type(e).__name__}: {e}", f"datasets[{i}]"
                ) from None
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if n >= length:
                raise JobError(
                    f"its first prompt has {n} tokens with the chat template; the generation length is {length} "
                    "(prompt plus new tokens; [engine] generate_max_len)",
                    f"datasets[{i}]",
                )

    def _check_template(self, job: RegenerateJob) -> None:
        field = "chat_template" if job.chat_template else "chat_template_kwargs"
        try:
            template = job_template(job)  # type: ignore[arg-type]  # the template fields of a job
            text = template.probe(self.context.tokenizer, [{"role": "user", "content": "ping"}], True)
        except OutsideRoots as e:
            raise JobError(str(e), "chat_template") from None
        except Exception as e:  # noqa: BLE001 - any template failure is the user's to fix
            raise JobError(f"the chat template cannot render a prompt: {type(e).__name__}: {e}", field) from None
        if "ping" not in text:
            raise JobError("the chat template does not render the user's message", field)

    # ------------------------------------------------------------------ the run
    def execute(self) -> JobResult:
        """Run the job to its end, a cancel or a shutdown (callbacks.should_cancel); raises JobError."""
        with readable_failures(" (set [engine] generate_slots lower)"):
            return self._execute(self.job, self.cb)

    def _execute(self, job: RegenerateJob, cb: JobCallbacks) -> JobResult:
        self.check(job)
        work = self._work(job, cb)
        plan = self._plan(job, work)
        output = ShardOutput(job.output_dir, job.output_roots)
        decoder: SlotDecoder | None = None
        try:
            output.start(plan)
            work.done = output.done_shards()
            cb.on_event(
                "prompts",
                {
                    "prompts": len(work.ids),
                    "rows": work.total_rows,
                    "skipped_lines": work.skipped,
                    "shards": len(work.shards),
                    "shards_done": len(work.done),
                },
            )
            decoder = self._decoder(work)
            stopped = self._generate(work, decoder, output)
            if not stopped:
                output.finish()
        finally:
            output.close()
            del decoder  # the cache goes back to the device before training jobs run again
            if self.context.targets[0].device.type == "cuda":
                torch.cuda.empty_cache()
        rows = int(output.manifest["counts"]["rows"])
        final = str(Path(job.output_dir))
        return JobResult(
            "STOPPED" if stopped else "SUCCEEDED", rows, work.total_rows, final, skipped_lines=work.skipped
        )

    def _work(self, job: RegenerateJob, cb: JobCallbacks) -> _Work:
        """The job's prompts and rows, fixed before anything is generated (the module says how)."""
        length = generation_length(self.context)
        prompts, ids, sources, skipped = self._prompts(job, length, cb)
        if not ids:
            raise JobError("the datasets hold no usable prompt", "datasets")
        order = sorted(
            ((p, s) for p in range(len(ids)) for s in range(job.samples_per_prompt)), key=lambda r: -len(ids[r[0]])
        )
        shards = [order[i : i + job.shard_rows] for i in range(0, len(order), job.shard_rows)]
        return _Work(prompts, ids, sources, skipped, length, shards, len(ids) * job.samples_per_prompt)

    def _decoder(self, work: _Work) -> SlotDecoder:
        """A decoder with as many slots as the device's memory allows (and the rows left need)."""
        target = self.context.targets[0]
        slots = min(generation_slots(self.context, work.length), max(1, work.total_rows - work.rows_done))
        decoder = SlotDecoder(target.model, slots, work.length)
        fields = {
            "slots": slots,
            "length": work.length,
            "kv_cache_bytes": decoder.cache.nbytes,
            "stacked_qkv_bytes": decoder.qkv.nbytes if decoder.qkv is not None else 0,
            "cuda_graph": decoder.use_graph,
            "ride_rows": decoder.ride_rows,
            "ride_widths": list(decoder.ride_widths),
        }
        log.info("regeneration decoder", extra={"fields": {**fields, "device": str(target.device)}})
        self.cb.on_event("decoder", fields)
        return decoder

    def _prompts(
        self, job: RegenerateJob, length: int, cb: JobCallbacks
    ) -> tuple[list[tuple[list[dict[str, str]], str]], list[np.ndarray], list[dict[str, Any]], int]:
        """The prompts' messages and token ids in reading order, the sources with their hashes,
        and the records skipped. A prompt that leaves no room for one new token is a bad record."""
        tokenizer = self.context.tokenizer
        template = job_template(job)  # type: ignore[arg-type]
        messages: list[tuple[list[dict[str, str]], str]] = []
        ids: list[np.ndarray] = []  # int32 arrays: a large dataset's token ids stay compact
        sources: list[dict[str, Any]] = []
        report = ReadReport()
        for i, entry in enumerate(job.datasets):
            try:
                path = resolved_under(entry, job.dataset_roots, "dataset")
            except OutsideRoots as e:
                raise JobError(str(e), f"datasets[{i}]") from None
            try:
                shown = relative_to_output(entry, job.output_dir)
                sources.append({"dataset": shown, "sha256": _tree_hash(path, entry, job.dataset_roots)})
                prompts = read_prompts(
                    path, skip_bad_lines=job.skip_bad_lines, report=report, name=entry, roots=job.dataset_roots
                )
                for prompt in prompts:
                    text = template.render(tokenizer, prompt.messages, True)
                    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
                    if len(tokens) >= length:
                        err = DatasetError(
                            prompt.source, 0, f"the prompt has {len(tokens)} tokens; the generation length is {length}"
                        )
                        if not job.skip_bad_lines:
                            raise err
                        report.note_skip(err)
                        continue
                    source = shown + prompt.source[len(entry) :] if prompt.source.startswith(entry) else prompt.source
                    messages.append((prompt.messages, source))
                    ids.append(np.asarray(tokens, dtype=np.int32))
            except (DatasetError, OutsideRoots) as e:
                raise JobError(str(e), f"datasets[{i}]") from None
        if report.skipped:
            cb.on_event("skipped_lines", {"count": report.skipped, "first": report.first_errors})
        return messages, ids, sources, report.skipped

    def _plan(self, job: RegenerateJob, work: _Work) -> dict[str, Any]:
        """What the output is a function of: a resume continues only an output of the same plan."""
        context = self.context
        template = job_template(job)  # type: ignore[arg-type]
        template_text = template.template or getattr(context.tokenizer, "chat_template", None) or ""
        # the target named as a checkpoint trained on this output names it (one identity everywhere)
        target = (
            target_identity(context.parts.target_path)
            if context.parts
            else {"config_sha256": config_sha256(context.targets[0].config.to_dict())}
        )
        return {
            "sources": work.sources,
            "target": target,
            "chat_template": {
                "file": relative_to_output(job.chat_template, job.output_dir) if job.chat_template else None,
                "sha256": hashlib.sha256(str(template_text).encode()).hexdigest(),
                "kwargs": job.chat_template_kwargs,
            },
            "sampling": {
                "temperature": job.temperature,
                "top_p": job.top_p,
                "top_k": job.top_k,
                "seed": job.seed,
                "max_new_tokens": job.max_new_tokens,
                "stop_token_ids": list(self._stop_tokens()),
            },
            "samples_per_prompt": job.samples_per_prompt,
            "shard_rows": job.shard_rows,
            "generation_length": work.length,
            "prompts": len(work.ids),
            "rows": work.total_rows,
            "skipped_records": work.skipped,
        }

    def _stop_tokens(self) -> tuple[int, ...]:
        """End-of-sequence tokens of the tokenizer and of the target's generation config."""
        ids: list[int] = []
        eos = getattr(self.context.targets[0].model.generation_config, "eos_token_id", None)
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
        tok = getattr(self.context.tokenizer, "eos_token_id", None)
        if tok is not None:
            ids.append(int(tok))
        return tuple(sorted({int(i) for i in ids}))

    def _generate(self, work: _Work, decoder: SlotDecoder, output: ShardOutput) -> bool:
        """Generate every shard not done; True when stopped (cancel or shutdown) before the end."""
        job, cb, tokenizer = self.job, self.cb, self.context.tokenizer
        prompts, ids, shards, done = work.prompts, work.ids, work.shards, work.done
        stops = self._stop_tokens()
        sampling = Sampling(job.temperature, job.top_p, job.top_k, stops)
        pending: dict[int, list[dict[str, Any] | None]] = {
            i: [None] * len(shard) for i, shard in enumerate(shards) if i not in done
        }
        missing = {i: len(shards[i]) for i in pending}

        def requests() -> Iterator[Request]:
            for i in sorted(pending):
                for j, (p, s) in enumerate(shards[i]):
                    yield Request((i, j), ids[p].tolist(), job.max_new_tokens, row_seed(job.seed, p, s))

        meter = _Progress(cb, work.total_rows, work.rows_done, job.samples_per_prompt)
        stopped = cb.should_cancel()
        if stopped:
            return True
        for completion in decoder.generate(requests(), sampling, should_stop=cb.should_cancel):
            i, j = cast(tuple[int, int], completion.key)
            p, s = shards[i][j]
            tokens = completion.tokens
            if completion.finish_reason == "stop" and tokens and tokens[-1] in stops:
                tokens = tokens[:-1]
            pending[i][j] = {
                "messages": [*prompts[p][0], {"role": "assistant", "content": tokenizer.decode(tokens)}],
                "source": prompts[p][1],
                "sample": s,
                "prompt_tokens": completion.prompt_tokens,
                "completion_tokens": len(completion.tokens),
                "finish_reason": completion.finish_reason,
            }
            missing[i] -= 1
            meter.row(decoder.tokens_generated)
            if missing[i] == 0:
                path = output.write_shard(i, [r for r in pending.pop(i) if r is not None])
                cb.on_checkpoint(path, int(output.manifest["counts"]["rows"]))
            meter.report(decoder.tokens_generated)
        stopped = bool(pending)
        meter.report(decoder.tokens_generated, force=True)
        return stopped


def relative_to_output(path: str, output_dir: str) -> str:
    """`path` as the output records it: relative to the output directory."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(output_dir))


@dataclass
class _Work:
    """A regeneration's work plan: prompts in reading order, rows (prompt, sample) in shards."""

    prompts: list[tuple[list[dict[str, str]], str]]  # (messages, source) per prompt
    ids: list[np.ndarray]  # each prompt's token ids
    sources: list[dict[str, Any]]  # the datasets with their hashes
    skipped: int  # records skipped
    length: int  # cache positions per sequence
    shards: list[list[tuple[int, int]]]
    total_rows: int
    done: set[int] = field(default_factory=set)  # shards an earlier run of the same plan wrote

    @property
    def rows_done(self) -> int:
        return sum(len(self.shards[i]) for i in self.done if i < len(self.shards))


class _Progress:
    """Rows done, tokens generated and their rates over this run, reported every few seconds."""

    def __init__(self, cb: JobCallbacks, total: int, done: int, samples: int):
        self.cb, self.total, self.rows_done, self.samples = cb, total, done, samples
        self.first = done
        self.started = time.monotonic()
        self.last = 0.0
        self.tokens = 0
        self.reported_tokens = 0

    def row(self, tokens: int) -> None:
        self.rows_done += 1
        self.tokens = tokens

    def report(self, tokens: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < PROGRESS_SECONDS:
            return
        self.tokens = tokens
        elapsed = max(now - self.started, 1e-9)
        rows_rate = (self.rows_done - self.first) / elapsed
        remaining = self.total - self.rows_done
        self.cb.on_generate(
            {
                "rows_done": self.rows_done,
                "rows_total": self.total,
                "prompts_done": self.rows_done // self.samples,
                "prompts_total": self.total // self.samples,
                "tokens_generated": tokens,
                "new_tokens": tokens - self.reported_tokens,
                "tokens_per_second": round(tokens / elapsed, 3),
                "eta_seconds": round(remaining / rows_rate, 1) if rows_rate > 0 else None,
                "seconds": round(elapsed, 3),
            }
        )
        self.reported_tokens = tokens
        self.last = now


def _tree_hash(path: Path, name: str, roots: list[str] | list[Path]) -> str:
    """sha256 over the files a dataset entry is read from (names included), each under `roots`;
    a datasets.save_to_disk directory's regular files in sorted order (its symlinks skipped)."""
    h = hashlib.sha256()
    files: list[Path] = []
    for src in dataset_files(path, name):
        real = resolved_under(src.path, roots, "a dataset file", src.name)
        if real.is_dir():
            files += sorted(p for p in real.rglob("*") if p.is_file() and not p.is_symlink())
        else:
            files.append(real)
    for f in files:
        if f.name == MANIFEST or f.name.startswith("."):
            continue
        h.update(str(f.relative_to(path) if f.is_relative_to(path) else f.name).encode() + b"\0")
        with open_regular(f, name) as fh:  # never a FIFO's wait
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
