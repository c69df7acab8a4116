"""The records a continual job trains on: new ones in arrival order, a bounded replay of older
ones, and a window of recent held-out records for the publish evaluation; and the micro-batch
stream the feature pipeline reads from them.

Every micro-batch has the engine's one shape (seq_len tokens, num_anchors anchors): documents
are packed into it as a training job packs them, so nothing compiles or allocates differently
when data arrives. Of its seq_len tokens, a share of about (1 - replay_ratio) comes from new
records (at least one when any is waiting) and the rest from records drawn at random from the
replay pool, which holds the initial datasets and the last `replay_records` records trained. A
record is trained once as new and then joins the replay pool.

With nothing new waiting the stream waits (on a condition, woken by the ingest thread) rather
than train on replay alone, so an idle source idles the job; a replay_ratio of 1 trains on
replay alone and never waits once the pool holds anything.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..config import ShapeConfig
from ..data.batches import MicroBatch, make_micro_batch
from ..data.conversations import Conversation
from ..data.packing import build_sequence, trainable_after_truncation

# how long a waiting reader sleeps between looks at its stop flag (it is woken by new records)
WAIT_SECONDS = 0.5
REPLAY_DRAWS = 8  # draws from the replay pool that may miss (too long to fit) before a batch is closed


class StreamStopped(Exception):
    """The job is stopping: the micro-batch that was waited for will not be trained."""


@dataclass
class Doc:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    seq: int = -1  # arrival number of a record read from a source (-1: an initial dataset's)


class RecordPool:
    """Thread-safe: the ingest thread adds, the pipeline's target threads take."""

    def __init__(self, seq_len: int, replay_capacity: int, heldout_capacity: int, heldout_every: int):
        self.seq_len = seq_len
        self.fresh: collections.deque[Doc | int] = collections.deque()  # an int: a corpus document
        # the arrival numbers of the records in `fresh`, in its order, which is theirs (records
        # arrive in order, are taken from the front and given back to it sorted): the oldest
        # record not yet taken is the first
        self._waiting: collections.deque[int] = collections.deque()
        self.replay: list[Doc] = []  # a ring of the last replay_capacity records trained
        self.replay_capacity = max(1, replay_capacity)
        self._ring_at = 0
        self.corpus = None  # the initial datasets' corpus (Corpus or DocumentList): replay too
        self.corpus_trainable: np.ndarray = np.zeros(0, dtype=np.int64)
        self.heldout: collections.deque[Conversation] = collections.deque(maxlen=max(1, heldout_capacity))
        self.heldout_every = max(0, heldout_every)
        self.added = 0  # new records seen (held out or not)
        self.trained_new = 0
        self.cond = threading.Condition()

    # ------------------------------------------------------------------ adding
    def add(self, conversation: Conversation, doc: Doc) -> None:
        """A record read from a source: every heldout_every-th is held out for evaluation."""
        if not trainable_after_truncation(doc.loss_mask, self.seq_len):
            return
        with self.cond:
            self.added += 1
            doc = Doc(doc.input_ids[: self.seq_len], doc.loss_mask[: self.seq_len], self.added)
            if self.heldout_every and self.added % self.heldout_every == 0:
                self.heldout.append(conversation)
                return
            self.fresh.append(doc)
            self._waiting.append(doc.seq)
            self.cond.notify_all()

    def set_corpus(self, corpus, heldout: list[Conversation], exclude: np.ndarray, *, fresh: bool) -> None:
        """The initial datasets: replay material for the job's whole life, and on its first run
        (fresh) trained once as new records first; `exclude`: their held-out documents."""
        with self.cond:
            self.corpus = corpus
            trainable = corpus.trainable().copy() if len(corpus) else np.zeros(0, dtype=bool)
            trainable[exclude] = False
            self.corpus_trainable = np.flatnonzero(trainable)
            if fresh:
                self.fresh.extend(int(i) for i in self.corpus_trainable)
            self.heldout.extend(heldout)
            self.cond.notify_all()

    def _to_replay(self, doc: Doc) -> None:
        if len(self.replay) < self.replay_capacity:
            self.replay.append(doc)
        else:
            self.replay[self._ring_at] = doc
            self._ring_at = (self._ring_at + 1) % self.replay_capacity

    @property
    def pending(self) -> int:
        return len(self.fresh)

    def heldout_window(self) -> list[Conversation]:
        with self.cond:
            return list(self.heldout)

    # ------------------------------------------------------------------ taking
    def _replay_size(self) -> int:
        return len(self.replay) + len(self.corpus_trainable)

    def _corpus_doc(self, i: int) -> Doc:
        assert self.corpus is not None
        ids, mask = self.corpus.document(i)
        return Doc(np.asarray(ids[: self.seq_len]), np.asarray(mask[: self.seq_len]))

    def _replay_doc(self, rng: np.random.Generator) -> Doc:
        i = int(rng.integers(self._replay_size()))
        if i < len(self.replay):
            return self.replay[i]
        return self._corpus_doc(int(self.corpus_trainable[i - len(self.replay)]))

    def _next_fresh(self) -> Doc:
        head = self.fresh[0]
        if isinstance(head, int):  # resolved when it is next: a large corpus is never held in memory
            head = self.fresh[0] = self._corpus_doc(head)
        return head

    def take(self, replay_ratio: float, rng: np.random.Generator) -> tuple[list[Doc], int] | None:
        """The documents of one packed sequence (the first n of them new), None when it must
        wait for new records. Call under self.cond."""
        budget = self.seq_len
        docs: list[Doc] = []
        if replay_ratio < 1.0:
            if not self.fresh:
                return None
            new_share = max(1, round((1.0 - replay_ratio) * budget))
            used = 0
            while self.fresh and (not docs or used + len(self._next_fresh().input_ids) <= new_share):
                if used + len(self._next_fresh().input_ids) > budget:
                    break
                doc = self._next_fresh()
                self.fresh.popleft()
                if doc.seq >= 0:
                    self._waiting.popleft()
                docs.append(doc)
                used += len(doc.input_ids)
                self.trained_new += 1
                if doc.seq >= 0:  # a corpus document is replayed from the corpus
                    self._to_replay(doc)
            budget -= used
        elif not self._replay_size():
            return None
        fresh = len(docs)
        if replay_ratio > 0 and self._replay_size():
            misses = 0
            while budget >= 2 and misses < REPLAY_DRAWS:
                doc = self._replay_doc(rng)
                if len(doc.input_ids) > budget or any(d is doc for d in docs):
                    misses += 1
                    continue
                docs.append(doc)
                budget -= len(doc.input_ids)
        return docs, fresh

    def oldest_waiting(self) -> int | None:
        """The arrival number of the oldest record not yet taken (None: none waits). Call under
        self.cond."""
        return self._waiting[0] if self._waiting else None

    def give_back(self, docs: list[Doc]) -> None:
        """New records of micro-batches that will not be trained, first in line again (in their
        arrival order: micro-batches packed out of order hold them out of order)."""
        docs = sorted(docs, key=lambda d: d.seq)
        with self.cond:
            self.fresh.extendleft(reversed(docs))
            self._waiting.extendleft(reversed([d.seq for d in docs if d.seq >= 0]))
            self.trained_new -= len(docs)
            self.cond.notify_all()


class ContinualStream:
    """The micro-batch stream of a continual job (the interface FeaturePipeline reads:
    `get(index)`): micro-batch g is packed from the pool when it is asked for, waiting for new
    records when there are none. `built(lo, hi)`: micro-batches lo..hi-1 are all packed, so the
    step that trains them will not wait for data."""

    per_epoch = 1  # an endless job has no epochs; StepStats.epoch counts micro-batches then

    def __init__(self, pool: RecordPool, shape: ShapeConfig, pad_token_id: int, seed: int, replay_ratio: float):
        self.pool, self.shape, self.pad, self.seed = pool, shape, pad_token_id, seed
        self.replay_ratio = replay_ratio
        self.stop = threading.Event()
        self._new: dict[int, list[Doc]] = {}  # packed micro-batch not yet trained -> its new records
        self._low = 0  # every index below is built and forgotten
        # every record with an arrival number up to this is trained (or held out): a prefix, what a
        # checkpoint's cursor may move past; never the newest record trained, since micro-batches
        # are packed out of order by several target threads, and after a rewind given-back records
        # wait behind others already trained
        self.trained_seq = 0

    def get(self, index: int) -> MicroBatch:
        rng = np.random.default_rng([self.seed, 2, index])
        with self.pool.cond:
            if index in self._new or index < self._low:
                # a thread of a closed pipeline, late: its micro-batch is packed again (or trained)
                # by the new one, and records taken here would count as trained without training
                raise StreamStopped
            while (taken := self.pool.take(self.replay_ratio, rng)) is None:
                if self.stop.is_set():
                    raise StreamStopped
                self.pool.cond.wait(WAIT_SECONDS)
            docs, fresh = taken
            self._new[index] = docs[:fresh]
            self.pool.cond.notify_all()
        seq = build_sequence([(d.input_ids, d.loss_mask) for d in docs], self.shape.seq_len, self.pad)
        return make_micro_batch(seq, self.shape, rng, index)

    def built(self, lo: int, hi: int) -> bool:
        """Micro-batches lo..hi-1 are packed (asked in step order: the step about to run)."""
        with self.pool.cond:
            done = all(i in self._new or i < self._low for i in range(lo, hi))
            if done:
                for i in [i for i in self._new if i < hi]:
                    del self._new[i]
                self._low = max(self._low, hi)
                self.trained_seq = self._trained_prefix()
            return done

    def _trained_prefix(self) -> int:
        """One less than the oldest record not trained: in a micro-batch packed but not trained,
        or not taken yet (all records, when none waits). Call under pool.cond."""
        untrained = [d.seq for docs in self._new.values() for d in docs if d.seq >= 0]
        waiting = self.pool.oldest_waiting()
        if waiting is not None:
            untrained.append(waiting)
        return min(untrained) - 1 if untrained else self.pool.added

    def wait_built(self, lo: int, hi: int, stop: Callable[[], bool]) -> bool:
        """Wait until micro-batches lo..hi-1 are packed; False when `stop()` said stop first."""
        while not self.built(lo, hi):
            if stop():
                return False
            with self.pool.cond:
                self.pool.cond.wait(WAIT_SECONDS)
        return True

    def close(self) -> None:
        self.stop.set()
        with self.pool.cond:
            self.pool.cond.notify_all()

    def rewind(self, first: int) -> None:
        """After the pipeline was closed before micro-batch `first`: the micro-batches packed from
        there on are dropped and their new records go back to the pool, first in line; the
        stream can be read again (a new pipeline starts at `first`)."""
        with self.pool.cond:
            dropped = sorted(i for i in self._new if i >= first)
            docs = [d for i in dropped for d in self._new.pop(i)]
            self.stop.clear()
            # in the same hold of the lock: the records are never out of both the stream and the pool
            self.pool.give_back(docs)
