"""The ingest thread of a continual job: it polls the watched sources and the job's ingest spool
every `poll_seconds` (a timed wait, never a busy loop), turns each new record into a tokenized
document with the job's chat template, and hands it to the record pool.

A bad record (unreadable, not a conversation) is skipped and counted, never the job's failure:
a live source is written by someone else while the job runs, and one broken line must not stop
a job that has no end. The first few are reported with their places.

Tokenization shares the tokenizer with the job's thread (answered prompts) and with the drafter's
thread evaluating for it (a publish, the drift after a target swap: a turn per prompt); they take
turns record by record (`turns.py`), and the watcher's cursor is locked
only while the watcher reads (one step of its generator: at most a listing of the sources or one
chunk of a file), so the job's thread, which reports how far the ingest spool was read after every
step, never waits for a whole poll.
"""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.conversations import Conversation, parse_conversation
from ..data.errors import DatasetError
from ..data.tokenize import ChatTemplate, encode_conversation
from .answer import Answerer
from .replay import Doc, RecordPool
from .sources import SourceWatcher
from .turns import TokenizerTurns

log = logging.getLogger("dflash.continual")
FIRST_ERRORS = 10


@dataclass
class FeedCounts:
    ingested: int = 0  # records read and tokenized (trained or held out)
    skipped: int = 0
    first_errors: list[str] = field(default_factory=list)
    reported_skips: int = 0


class Feed:
    def __init__(
        self,
        watcher: SourceWatcher,
        pool: RecordPool,
        tokenizer: Any,
        template: ChatTemplate,
        poll_seconds: float,
        answerer: Answerer | None = None,
        max_pending: int | None = None,
    ):
        """answerer: where prompt-only records go to be answered by the target (None: they are
        skipped); max_pending: the sources are not read while this many records wait to be
        trained (they stay in their files, read on later), so a large backlog is not held in memory."""
        self.watcher, self.pool, self.tokenizer, self.template = watcher, pool, tokenizer, template
        self.answerer = answerer
        self.max_pending = max_pending
        self.poll_seconds = max(0.05, poll_seconds)
        self.tokenizer_turns = TokenizerTurns()
        self.counts = FeedCounts()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        # the watcher's cursor (moved here, read by the job's thread) and the checkpoint's cursor
        # below (_base, _last, _deltas, _answered)
        self._lock = threading.Lock()
        self._counting = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="continual-ingest", daemon=True)
        # a checkpoint saves the newest cursor all of whose records are trained (cursor_through):
        # the cursor at the oldest such point (_base), then what each poll that read something
        # changed, with the records arrived by then and the newest prompt it sent to be answered (0:
        # none) (_deltas). Deltas, not whole cursors: a source of many files would otherwise copy
        # every file's entry at every poll until a checkpoint. A prompt's line is trained once its
        # answer is: _answered holds (prompts answered through that arrival, records arrived by
        # then), both growing, as the job's thread adds the answers
        self._base: dict[str, dict[str, Any]] = watcher.cursor()["files"]
        self._last: dict[str, dict[str, Any]] = {k: dict(v) for k, v in self._base.items()}
        self._deltas: list[tuple[int, int, dict[str, dict[str, Any]]]] = []
        self._answered: list[tuple[int, int]] = []

    def start(self) -> Feed:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=60)

    def lines_read(self, directory: Path) -> dict[str, int]:
        """JSONL lines read so far per file directly in `directory` (the ingest spool), by name."""
        with self._lock:
            files = list(self.watcher.files.items())
        return {Path(k).name: int(v.get("line", 1)) - 1 for k, v in files if Path(k).parent == directory}

    def cursor_through(self, seq: int) -> dict[str, Any]:
        """The newest cursor whose records all have arrival numbers up to `seq` (all trained):
        a job resumed from it reads again only what it had not trained."""
        with self._lock:
            trained = 0
            while trained < len(self._deltas) and self._trained(*self._deltas[trained][:2], seq):
                self._base.update(self._deltas[trained][2])
                trained += 1
            del self._deltas[:trained]
            # the marks no delta left waits for go, but the newest: a poll still reading may have
            # sent prompts that are answered already
            waiting = [prompts for _, prompts, _ in self._deltas if prompts]
            older = [m for m in self._answered[:-1] if waiting and m[0] >= waiting[0]]
            self._answered = older + self._answered[-1:]
            return {"files": {k: dict(v) for k, v in self._base.items()}}

    def _trained(self, arrived: int, prompts: int, seq: int) -> bool:
        """Whether the records of a poll (arrival numbers up to `arrived`) and the answers to its
        prompts (arrival numbers up to `prompts` at the answerer) are all trained by `seq`."""
        if arrived > seq:
            return False
        if not prompts:
            return True
        # the first mark past the poll's prompts is the earliest point all of them were answered
        at = bisect.bisect_left(self._answered, (prompts, -1))
        return at < len(self._answered) and self._answered[at][1] <= seq

    def answered(self, through: int) -> None:
        """The job's thread added the answers to the prompts up to arrival number `through`."""
        with self._lock:
            self._answered.append((through, self.pool.added))

    @property
    def full(self) -> bool:
        waiting = self.pool.pending + (self.answerer.pending if self.answerer is not None else 0)
        return self.max_pending is not None and waiting >= self.max_pending

    def poll_once(self) -> int:
        """Read what the sources hold now into the pool; the records added."""
        added = 0
        prompts_before = self.answerer.arrived if self.answerer is not None else 0
        # a full pool ends the poll between files: a backlog waits in its files, not in memory
        records = self.watcher.poll(enough=lambda: self.full)
        try:
            while True:
                with self._lock:  # the watcher's cursor moves only while it reads
                    record = next(records, None)
                if record is None:
                    break
                if self._stop.is_set():  # the job ends: what this poll read is read again on resume
                    return added
                if self._add(record.source, record.value):
                    added += 1
        finally:
            with self._lock:
                records.close()
        with self._lock:
            changed = {k: dict(v) for k, v in self.watcher.files.items() if self._last.get(k) != v}
            if changed:
                self._last.update(changed)
                prompted = self.answerer.arrived if self.answerer is not None else 0
                self._deltas.append((self.pool.added, prompted if prompted > prompts_before else 0, changed))
        return added

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.full:
                    self.poll_once()
                self._stop.wait(self.poll_seconds)
        except BaseException as e:  # noqa: BLE001 - the job's thread raises it as the job's failure
            self.error = e
            log.exception("the continual job's ingest thread failed")

    def _add(self, source: str, value: object) -> bool:
        try:
            if isinstance(value, DatasetError):
                raise value
            conversation = parse_conversation(value, source, 0)
        except DatasetError as e:
            prompt = _prompt(value)
            if prompt is None:
                self.skip(str(e))
            elif self.answerer is None:
                self.skip(f"{source}: a prompt without an answer, and the job has no regenerate settings")
            else:
                self.answerer.add(prompt, source)
                return True
            return False
        return self.add_conversation(Conversation(conversation.messages, source))

    def add_conversation(self, conversation: Conversation) -> bool:
        """A conversation tokenized into the pool (in a turn at the tokenizer); False when its
        template fails (skipped and counted)."""
        # in the pool before the turn ends: a thread given the next turn sees every record tokenized
        with self.tokenizer_turns.turn():
            try:
                encoded = encode_conversation(self.tokenizer, conversation, self.template, self.pool.seq_len)
            except DatasetError as e:
                self.skip(str(e))
                return False
            self.pool.add(conversation, Doc(encoded.input_ids, encoded.loss_mask))
        with self._counting:  # the ingest thread and the job's thread (answered prompts) both count
            self.counts.ingested += 1
        return True

    def skip(self, message: str) -> None:
        with self._counting:
            self.counts.skipped += 1
            if len(self.counts.first_errors) < FIRST_ERRORS:
                self.counts.first_errors.append(message)

    def new_skips(self) -> dict[str, Any] | None:
        """The skipped-records report when more were skipped since the last one."""
        if self.counts.skipped == self.counts.reported_skips:
            return None
        self.counts.reported_skips = self.counts.skipped
        return {"count": self.counts.skipped, "first": list(self.counts.first_errors)}


def _prompt(value: object) -> list[dict[str, str]] | None:
    """The messages of a record that asks for an answer (a prompt, no assistant turn after it)."""
    from ..data.prompts import parse_prompt

    try:
        return parse_prompt(value, "record", 0).messages
    except DatasetError:
        return None
