"""The continual run: a training run (train/run.py: the same step, drafters, feature
pipeline and checkpoints) whose data arrives while it runs and which has no end.

Its loop, per step: stop on a cancel; wait (a timed wait, woken by new records) until the step's
micro-batches are packed, so an idle source idles the job and a cancel is seen while it waits;
one step at the warmed shapes; every `publish_every_steps` steps the candidate's and the
published drafter's acceptance length on the held-out window of recent records, and a new
version published when the candidate wins by `publish_margin` (publish.py); the checkpoint when
due, with the sources' cursor beside it; at a checkpoint, with `yield_to_queue`, the job gives
the devices to a queued job (status YIELDED: the service queues it again behind that job, and it
resumes from this checkpoint).

The learning rate warms up over `warmup_ratio` of the first `publish_every_steps` steps and then
stays at `learning_rate`: a job without an end has no schedule to decay over.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import cpu_copy, load_drafter
from ..confine import ConfinedDir, OutsideRoots, resolved_under
from ..data.batches import DocumentList
from ..data.job import JobData
from ..engine.admission import check_init_from, check_output, check_shapes, check_template
from ..engine.api import JobCallbacks, JobError
from ..engine.checkpointing import Checkpointer, checkpoint_due, checkpoint_step
from ..engine.config import job_template
from ..engine.context import RunContext
from ..engine.guards import check_step
from ..engine.objective import check_objective
from ..engine.optim import lr_factor
from ..evaluate import evaluate_acceptance
from ..target_identity import resolve_export_dtype, target_identity
from ..train.evaluation import EvalSchedule
from ..train.run import NoCheckpoints, Prepared, TrainRun
from .answer import Answerer, answerer_for, check_answering
from .feed import Feed
from .job import ENDLESS_STEPS, STATE_FILE, ContinualJob
from .publish import Publisher, notify_reload
from .replay import ContinualStream, RecordPool
from .sources import SourceWatcher, create_missing, drop_read_spool, source_problem
from .target_swap import (
    SwapRefused,
    TargetSwapper,
    TargetWatch,
    check_target_watch,
    check_version,
    load_in_place,
    refresh_heads,
)

YIELDED = "YIELDED"  # the job's result when it gave the devices to a queued job
REPORT_SECONDS = 2.0  # how often the records' counts are reported while the job waits for data
STATES_KEPT = 8  # cursors kept in the state file, one per recent checkpoint


class ContinualRun(TrainRun):
    """A continual job on the built engine (the run protocol of engine/kinds.py)."""

    job: ContinualJob

    @classmethod
    def validate(cls, context: RunContext, job: ContinualJob) -> None:  # type: ignore[override]
        check_shapes(job, context.config)
        check_objective(job, context.config.teacher, context.config.recipe)
        if job.regenerate is not None:
            check_answering(context, job)
        if job.target_watch is not None:
            check_target_watch(context, job)
        for i, source in enumerate(job.sources):
            try:
                problem = source_problem(source, job.dataset_roots, job.output_roots)
            except OutsideRoots as e:
                raise JobError(str(e), f"sources[{i}]") from None
            if problem is not None:
                raise JobError(problem, f"sources[{i}]")
        if context.parts is not None:
            check_init_from(job, context.parts)
            check_template(job, context.parts)
            check_output(job, context.parts)

    def __init__(self, context: RunContext, job: ContinualJob, callbacks: JobCallbacks, resume_from: str | None):
        super().__init__(context, job, callbacks, resume_from)
        self.pool = RecordPool(context.config.seq_len, job.replay_records, job.eval_max_prompts, job.heldout_every)
        self.feed: Feed | None = None
        self.stream: ContinualStream | None = None
        self.publisher: Publisher | None = None
        self._published_drafter: tuple[int, Any] | None = None  # (version, drafter) evaluated against
        self._reported = 0.0
        self._writing: Checkpointer | NoCheckpoints | None = None  # the run's checkpoints, while it loops
        # a version being written (in the publisher's thread, as a checkpoint is: training goes on)
        self._publish_writer = cf.ThreadPoolExecutor(1, thread_name_prefix="continual-publish")
        self._publishing: tuple[cf.Future, dict[str, Any]] | None = None
        self.export_dtype = "fp32"  # the publish dtype: set from the target when the job prepares
        self.swapper: TargetSwapper | None = None
        self._swap_checked = 0.0
        self._swapped = False  # a watched version is loaded: the engine's own target comes back at the end
        self._published_tau: float | None = None  # the published drafter's, last measured
        self._identity: dict[str, Any] | None = None  # the loaded target version's, once one is
        self.answerer: Answerer | None = None
        self._train_seconds = 0.0  # since the last report of the split of time with answering

    # ------------------------------------------------------------------ preparing
    def prepare(self) -> Prepared:
        job, parts = self.job, self.parts
        no_data = JobData(DocumentList([]), [], np.zeros(0, dtype=np.int64))  # type: ignore[arg-type]
        data = self._load_data() if job.datasets else no_data
        self.pool.set_corpus(data.corpus, data.heldout, data.exclude, fresh=self.resume_from is None)
        for source in job.sources:
            if create_missing(source, job.output_roots):  # named before its writer wrote anything
                self.cb.on_event("source_created", {"source": source})
        directories = [
            (resolved_under(s, job.dataset_roots, "source"), s, list(job.dataset_roots)) for s in job.sources
        ]
        spool = ConfinedDir(job.spool_dir(), job.output_roots, "output_dir")  # created, so it can be watched
        spool.close()
        directories.append((job.spool_dir(), "records", list(job.output_roots)))
        cursor = self._saved_cursor() if self.resume_from else None
        if job.regenerate is not None:
            self.answerer = answerer_for(self.context, job)
        watcher = SourceWatcher(directories, cursor)
        template = job_template(job)
        self.feed = Feed(
            watcher, self.pool, parts.tokenizer, template, job.poll_seconds, self.answerer, job.max_pending_records
        )
        self.feed.poll_once()  # what the sources hold now, before the first step
        self.stream = ContinualStream(
            self.pool, self.context.config.shape, parts.pad_token_id, job.seed, job.replay_ratio
        )
        self.clock.mark("data_open")
        self.cb.on_event(
            "data",
            {
                "documents": len(data.corpus) - len(data.exclude),
                "tokens": int(data.corpus.lengths.sum()),
                "sources": len(job.sources),
                "records": self.feed.counts.ingested,
                "pending": self.pool.pending,
                "heldout": len(self.pool.heldout),
            },
        )
        start = self._start_state()
        self.clock.mark("start_state")
        target = target_identity(parts.target_path)
        try:
            self.publisher = Publisher(job.publish_dir, job.output_roots, job.keep_versions, target)
        except OutsideRoots as e:
            raise JobError(str(e), "publish_dir") from None
        self.export_dtype = resolve_export_dtype(job.export_dtype, target["dtype"])
        if job.target_watch is not None:
            watch = TargetWatch(job.target_watch, job.dataset_roots)
            heads = [r.head for r in self.replicas]
            self.swapper = TargetSwapper(watch, parts.targets, heads, job.dataset_roots)
            watch.newest()  # a version already there (a resumed job's target) is loaded before the first step
            self._maybe_swap(at_start=True)
        self.feed.start()
        return Prepared(data, self.stream, ENDLESS_STEPS, start)

    # ------------------------------------------------------------------ the loop
    def loop(self, data: JobData, checkpoints: Checkpointer | NoCheckpoints) -> None:
        job, cb = self.job, self.cb
        assert self.stream is not None and self.feed is not None
        self._writing = checkpoints
        warmup_steps = int(job.warmup_ratio * job.publish_every_steps)
        evaluation = EvalSchedule(job.publish_every_steps)  # no last step: only by count
        while True:
            if cb.should_cancel():
                self.status = "STOPPED"
                break
            self._answer()
            first = self.step * self.per_step
            if not self.stream.wait_built(first, first + self.per_step, self._idle):
                if self.status == YIELDED and self.step > self.start:  # resumes from the progress made
                    checkpoints.save(self.step, self.stats, self.eval_result, force=True)  # type: ignore[call-arg]
                break  # cancelled, or yielded while it waited
            lr = job.learning_rate * lr_factor(self.step, ENDLESS_STEPS, warmup_steps, 1.0)
            self.stats, _ = self.train_step(lr, False)
            self.step += 1
            check_step(self.stats)
            self.trained += self.stats.labels
            self._train_seconds += self.stats.step_seconds
            cb.on_step(self.stats)
            self.clock.first_step(cb.on_event)
            self._report_records(force=True)
            self._report_publish()
            if evaluation.due(self.step):
                self._evaluate_and_publish()
            checkpoints.save(self.step, self.stats, self.eval_result)
            self._maybe_swap()
            if checkpoint_due(job, self.step, ENDLESS_STEPS):
                self._save_cursor(self.step)
                if self._should_yield():
                    self.status = YIELDED
                    break

    def _idle(self) -> bool:
        """While the job waits for data: True to stop waiting (a cancel, or a yield to a queued
        job after a checkpoint of the progress made); reports the records' counts."""
        assert self.feed is not None
        if self.feed.error is not None:
            raise JobError(f"reading the sources failed: {type(self.feed.error).__name__}: {self.feed.error}")
        self._report_records()
        self._report_publish()
        self._answer()
        if self._writing is not None:
            # waiting for data: the engine's pinning, held for the job's first step, may go on
            self._writing.release_hold()
            if self.step > self.start:  # a write that finished is recorded now
                self._writing.save(self.step, self.stats, self.eval_result)
        self._maybe_swap()
        if self.cb.should_cancel():
            self.status = "STOPPED"
            return True
        if self._should_yield():
            self.status = YIELDED
            return True
        return False

    def _should_yield(self) -> bool:
        return self.job.yield_to_queue and self.cb.should_yield()

    def run(self, prepared: Prepared) -> str | None:
        try:
            last = super().run(prepared)
            if self.step > self.start and self.status != YIELDED:  # the checkpoint a stop wrote last
                self._save_cursor(self.step)
            return last
        finally:
            self._report_publish(wait=True)  # a version being written completes (or fails) first
            self._publish_writer.shutdown()
            self._restore_target()
            if self.feed is not None:
                self.feed.close()
            if self.publisher is not None:
                self.publisher.close()

    def step_stats(self, *args: Any, **kwargs: Any) -> Any:
        # a job without an end reports no total (the store shows no fraction done)
        return dataclasses.replace(super().step_stats(*args, **kwargs), total_steps=0)

    def _checkpoints(self) -> Checkpointer | NoCheckpoints:
        checkpoints = super()._checkpoints()
        if self._identity is not None and hasattr(checkpoints, "target"):  # a version loaded at the start
            checkpoints.target = self._identity
        return checkpoints

    def _close_pipeline(self) -> None:
        if self.stream is not None:  # first: a target thread waiting for records stops waiting
            self.stream.close()
        super()._close_pipeline()

    # ------------------------------------------------------------------ records
    def _report_records(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._reported < REPORT_SECONDS:
            return
        self._reported = now
        assert self.feed is not None
        # the lines read first: a record read after them is then counted as pending and as a line
        # not read yet (the ingest route's bound errs on the safe side), never as neither
        read = self.feed.lines_read(self.job.spool_dir())
        waiting = self.answerer.pending if self.answerer is not None else 0
        self.cb.on_records(
            {"ingested": self.feed.counts.ingested, "pending": self.pool.pending + waiting, "spool_lines_read": read}
        )
        skipped = self.feed.new_skips()
        if skipped is not None:
            self.cb.on_event("skipped_records", skipped)

    def _save_cursor(self, step: int) -> None:
        """The sources' cursor for the checkpoint of `step` (the newest all of whose records are
        trained), kept for the last few checkpoints: a resume reads on from its checkpoint's."""
        assert self.feed is not None and self.stream is not None
        states = self._read_states()
        states[str(step)] = self.feed.cursor_through(self.stream.trained_seq)
        kept = dict(sorted(states.items(), key=lambda kv: int(kv[0]))[-STATES_KEPT:])
        with ConfinedDir(self.job.output_dir, self.job.output_roots, "output_dir") as directory:
            tmp = f".{STATE_FILE}.tmp"
            with open(directory.at(tmp), "w") as f:
                f.write(json.dumps({"cursors": kept}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            directory.rename(tmp, STATE_FILE)
            directory.fsync()
        with ConfinedDir(self.job.spool_dir(), self.job.output_roots, "output_dir") as spool:
            drop_read_spool(spool, list(kept.values()))

    def _read_states(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.job.state_path().read_text()).get("cursors", {}))
        except (OSError, ValueError, AttributeError):
            return {}

    def _saved_cursor(self) -> dict[str, Any] | None:
        """The cursor of the checkpoint the job resumes from (else the newest before it): records
        after it are read again, so none is lost; None reads every source from its start."""
        assert self.resume_from is not None
        step = checkpoint_step(Path(self.resume_from).name) or 0
        older = [int(s) for s in self._read_states() if int(s) <= step]
        return self._read_states()[str(max(older))] if older else None

    # ------------------------------------------------------------------ answering prompts
    def _answer(self) -> None:
        """Between steps: the target answers waiting prompts, which then train as new records."""
        if self.answerer is None or not self.answerer.pending:
            return
        assert self.feed is not None
        conversations, skipped = self.answerer.answer(self.feed.tokenizer_turns.first)
        with self.feed.tokenizer_turns.first():
            for conversation in conversations:
                self.feed.add_conversation(conversation)
        self.feed.answered(self.answerer.answered_through)
        for reason in skipped:
            self.feed.skip(reason)
        report = self.answerer.report(self._train_seconds)
        if report is not None:
            self._train_seconds = 0.0
            self.cb.on_event("regenerate", {"step": self.step, **report})

    # ------------------------------------------------------------------ the target
    def _maybe_swap(self, at_start: bool = False) -> None:
        """Between steps, every poll_seconds: load a new target version from target_watch."""
        if self.swapper is None or (not at_start and time.monotonic() - self._swap_checked < self.job.poll_seconds):
            return
        self._swap_checked = time.monotonic()
        path = self.swapper.watch.newest()
        if path is None:
            return
        if not at_start:  # what reads the target stops; its packed micro-batches' new records go back
            assert self.stream is not None
            self.stream.close()
            super()._close_pipeline()
            self.stream.rewind(self.step * self.per_step)
        try:
            payload = self.swapper.swap(path)
        except SwapRefused as e:
            self.cb.on_target_swap({"version": path.name, "refused": True, "reason": str(e)})
        else:
            self._swapped = True
            identity = self._identity = target_identity(path)
            for holder in (self.publisher, self._writing):  # what versions and checkpoints now record
                if holder is not None and hasattr(holder, "target"):
                    holder.target = identity
            self.cb.on_target_swap({**payload, "refused": False, "target": identity, "step": self.step})
            self._measure_drift(path.name)
        finally:
            if not at_start:
                assert self.stream is not None
                self.pipeline = self._start_pipeline(self.stream, first_step=self.step)

    def _measure_drift(self, version: str) -> None:
        """The published drafter's acceptance length against the new target, at once."""
        assert self.publisher is not None and self.feed is not None
        latest, window = self.publisher.latest, self.pool.heldout_window()
        if latest is None or not window:
            return
        tau = self._published_tau_on(latest, window)
        self.cb.on_event(
            "drift",
            {"step": self.step, "version": version, "published_tau_before": self._published_tau, "published_tau": tau},
        )
        self._published_tau = tau

    def _restore_target(self) -> None:
        """The engine's own target back in place after the job loaded watched versions: the next
        job trains against the target the daemon was started with."""
        if self.swapper is None or not self._swapped:
            return
        where = check_version(self.parts.targets[0], Path(self.parts.target_path), [])
        load_in_place(self.parts.targets, where)
        refresh_heads(self.parts.targets[0], self.swapper.heads)
        self._swapped = False

    # ------------------------------------------------------------------ publishing
    def _evaluate_and_publish(self) -> None:
        assert self.feed is not None and self.publisher is not None
        window = self.pool.heldout_window()
        payload: dict[str, Any] = {"step": self.step, "heldout": len(window)}
        if not window:
            self.cb.on_publish({**payload, "published": False, "reason": "no held-out records yet"})
            return
        target, tokenizer = self.parts.targets[0], self.parts.tokenizer
        self._report_publish(wait=True)  # the previous version is the one to beat
        latest = self.publisher.latest
        # the tokenizer taken per prompt, not for the whole evaluation: ingest goes on meanwhile
        turn = self.feed.tokenizer_turns.first
        candidate = self.drafters.evaluate(target, tokenizer, window, self.job, turn)["acceptance_length"]
        published = self._published_tau_on(latest, window) if latest is not None else None
        self._published_tau = published
        payload.update(candidate_tau=candidate, published_tau=published)
        wins = published is None or (candidate > published and candidate >= published * (1 + self.job.publish_margin))
        if not wins:
            self.cb.on_publish({**payload, "published": False, "reason": "the candidate does not win by the margin"})
            return
        rep = self.replicas[0]
        weights = cpu_copy(rep.weights_state())  # now, between steps: the candidate that was evaluated
        publisher, config, dtype, url = self.publisher, rep.drafter.config, self.export_dtype, self.job.reload_url

        def write() -> dict[str, Any]:
            entry = publisher.publish(config, weights, step=payload["step"], tau=candidate, export_dtype=dtype)
            done = {**payload, "published": True, "version": entry["version"], "tau": candidate, "path": entry["path"]}
            if url:
                done["reload"] = notify_reload(url, entry)
            return done

        self._publishing = (self._publish_writer.submit(write), payload)

    def _report_publish(self, wait: bool = False) -> None:
        """Report a version whose write finished (wait: the one in flight, too)."""
        if self._publishing is None or not (wait or self._publishing[0].done()):
            return
        future, payload = self._publishing
        self._publishing = None
        try:
            self.cb.on_publish(future.result())
        except Exception as e:  # noqa: BLE001 - the previous version stays published; the job goes on
            self.cb.on_publish({**payload, "published": False, "reason": f"{type(e).__name__}: {e}"})

    def _published_tau_on(self, latest: dict[str, Any], window: list[Any]) -> float:
        """The published drafter's acceptance length on the same window, loaded once per version
        (the tokenizer taken per prompt, as ingest shares it)."""
        assert self.publisher is not None and self.feed is not None
        rep = self.replicas[0]
        if self._published_drafter is None or self._published_drafter[0] != latest["version"]:
            drafter = load_drafter(self.publisher.path_of(latest), rep.device)
            self._published_drafter = (latest["version"], drafter)
        drafter = self._published_drafter[1]
        result = (
            self.drafters.pools[0]
            .submit(
                evaluate_acceptance,
                self.parts.targets[0],
                drafter,
                self.parts.tokenizer,
                window[: self.job.eval_max_prompts],
                max_new_tokens=self.job.eval_max_new_tokens,
                drafter_device=rep.device,
                head=rep.head,
                tokenizer_turn=self.feed.tokenizer_turns.first,
            )
            .result()
        )
        return float(result.acceptance_length)
