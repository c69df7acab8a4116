"""One training job on the built engine: `TrainRun` holds the job's state from its admission to
its result, on every rank that runs it. It sees the engine as its RunContext (engine/context.py).

The run, in order: prepare (the job's data, tokenized where the cache lacks it; the micro-batch
stream; the first step's weights and optimizer state), agreed on and shared by the rank protocol
(engine/ranks.py); then the loop (`loop`): learning rate, one step across the drafters
(engine/drafters.py), the step's checks and callbacks, the weight check, evaluation when due
(evaluation.py), checkpoint, stop. Failures are the context managers' to handle: the
checkpointer lets a write in flight finish, the rank protocol votes the failure to the other
ranks, the feature pipeline closes, the replicas drop the job's state, and whatever was raised
becomes a readable JobError.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint import load_training_state, load_weights
from ..confine import OutsideRoots, resolved_under
from ..data.batches import BatchSource, MicroBatchStream
from ..data.job import Datasets, EvalSplit, JobData, load_job_data
from ..data.prepare import PrepareProgress
from ..data_home import CACHE_DIR
from ..engine.admission import admit_training, check_resume
from ..engine.api import JobCallbacks, JobError, JobResult, StepStats
from ..engine.checkpointing import Checkpointer, RunPlan, checkpoint_due
from ..engine.config import TrainJob
from ..engine.context import RunContext
from ..engine.distributed import weights_checksum
from ..engine.failures import readable_failures
from ..engine.guards import check_data_tokens, check_step, check_trained
from ..engine.optim import lr_factor
from ..engine.pipeline import FeaturePipeline, Span
from ..engine.replica import StepAccumulator
from ..engine.start_clock import StartClock
from ..engine.warmup import reset_weights
from ..step.blocks import expected_acceptance_length
from .evaluation import EvalSchedule

DATA_PROGRESS_SECONDS = 2.0  # how often a job preparing its data reports progress


@dataclass
class Prepared:
    data: JobData
    stream: BatchSource
    total: int  # the job's steps
    start: int  # the step it starts after (a resume's)

    def fingerprint(self) -> list[int]:
        """What every rank of a group must have read alike: micro-batches per epoch, tokens, steps."""
        return [self.stream.per_epoch, int(self.data.corpus.lengths.sum()), self.total]


class NoCheckpoints:
    """The checkpoints of a rank other than 0: none (rank 0 writes the job's)."""

    def __enter__(self) -> NoCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None: ...

    def save(self, step: int, stats: StepStats | None, eval_result: dict[str, Any] | None = None) -> None: ...

    def release_hold(self) -> None: ...

    def finish(
        self, step: int, stats: StepStats | None, eval_result: dict[str, Any] | None, write_last: bool
    ) -> str | None:
        return None


class TrainRun:
    @classmethod
    def validate(cls, context: RunContext, job: TrainJob) -> None:
        admit_training(job, context.config, context.parts)

    def __init__(self, context: RunContext, job: TrainJob, callbacks: JobCallbacks, resume_from: str | None):
        self.context, self.parts, self.job, self.cb = context, context.built, job, callbacks
        self.resume_from = resume_from
        self.ranks, self.drafters = context.ranks, context.drafters
        self.replicas = context.replicas
        self.per_step = len(self.replicas) * job.grad_accum * self.ranks.world  # micro-batches per step
        self.pipeline: FeaturePipeline | None = None
        self.per_epoch = 1
        self.step = self.start = self.total = 0
        self.stats: StepStats | None = None
        self.eval_result: dict[str, Any] | None = None
        self.trained = 0  # labelled block positions this run trained on
        self.status = "SUCCEEDED"
        self.step_began = 0.0  # when the running step began (time.monotonic)
        self.stop: str | None = None  # why the ranks stopped the job early (ranks.CANCEL, SHUTDOWN)
        self.clock = StartClock()  # where the time before the first step goes

    def admit(self) -> None:
        """On the process that took the job: the group can run it, it is valid, the others get it."""
        self.ranks.check_can_run()
        self.validate(self.context, self.job)
        self.ranks.send_job(self.job, self.resume_from)

    def execute(self) -> JobResult:
        """Train the job to its end, a cancel or a shutdown (callbacks.should_cancel); raises JobError."""
        with readable_failures(), self.drafters.job_scope():
            prepared = self.ranks.agree_start(self.prepare, self.cb.should_cancel)
            if prepared is None:
                return JobResult("STOPPED", 0, 0, self.resume_from)
            prepared.start = self.ranks.share_start(prepared.start)
            last = self.run(prepared)
        return JobResult(
            self.status, self.step, self.total, last, self.stats, self.eval_result, prepared.data.skipped_lines
        )

    # ------------------------------------------------------------------ the loop
    def run(self, prepared: Prepared) -> str | None:
        """The steps from the first to the end or a stop; the last checkpoint's path."""
        self.step = self.start = prepared.start
        self.total, self.per_epoch = prepared.total, prepared.stream.per_epoch
        self.context.rate.reset()
        with contextlib.ExitStack() as stack:  # unwound in reverse: abandon, vote, close the pipeline
            stack.callback(self._close_pipeline)
            stack.enter_context(self.ranks.voting())
            checkpoints = self._checkpoints()  # in the vote: an unusable output_dir fails every rank
            stack.enter_context(checkpoints)
            self.clock.mark("checkpointer")
            self.pipeline = self._start_pipeline(prepared.stream)
            self.clock.mark("pipeline_start")
            self.loop(prepared.data, checkpoints)
            stopped_after_progress = self.status == "STOPPED" and self.step > self.start
            last = checkpoints.finish(self.step, self.stats, self.eval_result, write_last=stopped_after_progress)
            self.ranks.agree_end()
        self.ranks.after_job(self.stop, self.step)
        return last

    def loop(self, data: JobData, checkpoints: Checkpointer | NoCheckpoints) -> None:
        job, cb, ranks = self.job, self.cb, self.ranks
        warmup_steps = int(job.warmup_ratio * self.total)
        evaluation = EvalSchedule(
            job.eval_interval,
            self.total,
            enabled=ranks.leads
            and bool(data.heldout)
            and bool(job.eval_interval or job.eval_fraction or job.eval_prompts),
        )
        # what the run starts from: a run that ends on the same bits trained nothing
        start_weights = self._weights_checksum() if self.step < self.total else None
        any_loss = any_grad = False
        while self.step < self.total:
            cancel = cb.should_cancel()
            if ranks.stops_before_step(cancel):
                self.status = "STOPPED"
                break
            lr = job.learning_rate * lr_factor(self.step, self.total, warmup_steps, job.min_lr_ratio)
            self.stats, self.stop = self.train_step(lr, cancel)
            self.step += 1
            check_step(self.stats)  # before the step is recorded or checkpointed
            self.trained += self.stats.labels
            any_loss = any_loss or self.stats.loss != 0.0
            any_grad = any_grad or self.stats.grad_norm != 0.0
            cb.on_step(self.stats)
            self.clock.first_step(cb.on_event)
            if self.step == self.total:  # before the last checkpoint: a job that trained on nothing writes none
                changed = start_weights is None or self._weights_checksum() != start_weights
                check_trained(
                    self.step - self.start, self.trained, any_loss=any_loss, any_grad=any_grad, weights_changed=changed
                )
            ranks.check_weights(self.step, self.stop is not None or checkpoint_due(job, self.step, self.total))
            if evaluation.due(self.step):
                self.eval_result = self.drafters.evaluate(
                    self.parts.targets[0], self.parts.tokenizer, data.heldout, job
                )
                cb.on_eval(self.step, self.eval_result)
            checkpoints.save(self.step, self.stats, self.eval_result)
            if self.stop is not None:
                self.status = "STOPPED"
                break

    def _weights_checksum(self) -> int:
        return weights_checksum(m for _, m in self.drafters.replicas[0].named_masters())

    def train_step(self, lr: float, cancel: bool) -> tuple[StepStats, str | None]:
        """One optimizer step across the drafters (and, in a group, the ranks)."""
        self.step_began = time.monotonic()
        assert self.pipeline is not None
        accs, norm, (totals, stop) = self.drafters.step(
            self.pipeline, self.job, lr, lambda futures, error: self.ranks.exchange_step(futures, error, cancel)
        )
        return self.step_stats(accs, totals, lr, norm), stop

    def step_stats(
        self, accs: list[StepAccumulator], totals: StepAccumulator | None, lr: float, norm: float
    ) -> StepStats:
        """The step's statistics: over every rank (`totals`, None: this rank's are the job's), except
        the per-device tokens and times, which are this rank's own."""
        seconds = time.monotonic() - self.step_began
        totals = totals if totals is not None else StepAccumulator.merged(accs)
        correct, counted = totals.correct.float(), totals.counted.float()
        first = self.parts.drafter_config.first_slot  # the layout's first drafting slot
        acc_per_pos = (correct[first:] / counted[first:].clamp_min(1)).tolist()
        per_dev, secs = self.drafters.count(accs, seconds)
        # rank 0 reports the job's rate; the other ranks their own devices'
        rate = self.context.rate
        rate.add(totals.context_tokens if self.ranks.leads else sum(per_dev.values()), seconds)
        step = self.step + 1
        return StepStats(
            step=step,
            total_steps=self.total,
            loss=float(totals.loss_sum) / totals.micro_batches,
            position_accuracy=acc_per_pos,
            expected_acceptance_length=expected_acceptance_length([1.0, *acc_per_pos]),
            context_tokens=totals.context_tokens,
            tokens_per_device=per_dev,
            step_seconds=seconds,
            seconds_per_device=secs,
            tokens_per_second=rate.rate(),
            learning_rate=lr,
            grad_norm=norm,
            epoch=step * self.per_step / self.per_epoch,
            labels=int(counted[first:].sum().item()),
        )

    def _checkpoints(self) -> Checkpointer | NoCheckpoints:
        if not self.ranks.leads:
            return NoCheckpoints()
        plan = RunPlan(
            total_steps=self.total,
            micro_batches_per_step=self.per_step,
            replicas=len(self.replicas) * self.ranks.world,
            resumed_from=self.resume_from,
        )
        return Checkpointer(
            self.job, self.replicas[0], self.cb, plan, target_path=self.parts.target_path, snapshot=self.parts.snapshot
        )

    def _start_pipeline(self, stream: BatchSource, first_step: int | None = None) -> FeaturePipeline:
        """The feature pipeline from the micro-batches of `first_step` (default: the run's first)."""
        span = Span(
            first=(self.start if first_step is None else first_step) * self.per_step,
            end=self.total * self.per_step,
            grad_accum=self.job.grad_accum,
            rank=self.ranks.rank,
            per_step=self.per_step,
        )
        timeline = self.context.timeline
        pipeline = FeaturePipeline(
            self.parts.targets,
            [r.device for r in self.replicas],
            stream,
            span,
            feature_spec=self.parts.feature_spec,
            on_thread=lambda n: timeline.mark(f"thread:{n}"),
        )
        return self.context.live.show(pipeline.start())

    def _close_pipeline(self) -> None:
        self.context.live.clear()
        if self.pipeline is not None:
            self.pipeline.close()

    # ------------------------------------------------------------------ preparing
    def prepare(self) -> Prepared:
        """This rank's data, micro-batch stream, step count and first step, with the replicas
        holding the first step's state."""
        job = self.job
        try:
            data = self._load_data()
        except OutsideRoots as e:
            raise JobError(str(e), "datasets") from None
        self.clock.mark("data_open")
        stream = MicroBatchStream(
            data.corpus, self.context.config.shape, self.parts.pad_token_id, seed=job.seed, exclude=data.exclude
        )
        total = job.steps or max(1, math.ceil((job.epochs or 0) * stream.per_epoch / self.per_step))
        check_data_tokens(int(data.corpus.lengths.sum()))
        self.clock.mark("batch_plan")
        self.cb.on_event(
            "data",
            {
                "documents": len(data.corpus) - len(data.exclude),
                "tokens": int(data.corpus.lengths.sum()),
                "micro_batches_per_epoch": stream.per_epoch,
                "truncated_documents": data.corpus.truncated_documents,
                "dropped_documents": stream.report.dropped_documents,
                "heldout": len(data.exclude) or len(data.heldout),
                "total_steps": total,
            },
        )
        start = self._start_state()
        self.clock.mark("start_state")
        return Prepared(data, stream, total, start)

    def _load_data(self) -> JobData:
        """Tokenize what the cache lacks (reported as the job's preparing_data phase) and open it."""
        job, cb = self.job, self.cb
        data = load_job_data(
            Datasets(job.datasets, skip_bad_lines=job.skip_bad_lines, roots=job.dataset_roots),
            self.context.tokenization(job),
            self.context.data_dir / CACHE_DIR / "tokens",
            EvalSplit(job.eval_prompts, job.eval_fraction, job.eval_max_prompts, job.seed),
            progress=DataProgress(cb),
            should_stop=lambda: cb.should_cancel() or self.ranks.stop_signalled(),
        )
        if data.skipped_lines:
            cb.on_event("skipped_lines", {"count": data.skipped_lines, "first": data.skip_messages})
        return data

    def _start_state(self) -> int:
        """Weights, optimizer, RNG and loss weights for the job's first step; the step it starts
        at. Only rank 0 reads a checkpoint (the others get its state from share_start)."""
        job = self.job
        resume_from = self.resume_from if self.ranks.leads else None
        source = (resume_from or job.init_from) if self.ranks.leads else None  # a resume starts from its checkpoint
        try:  # a checkpoint is read only from where the job may read when it runs, a resume's too
            if source and job.init_from and not resume_from:
                source = str(resolved_under(job.init_from, job.dataset_roots + job.output_roots, "init_from"))
            elif resume_from:
                source = str(resolved_under(resume_from, job.output_roots, "the checkpoint to resume from"))
        except OutsideRoots as e:
            raise JobError(str(e), "init_from" if not resume_from else "output_dir") from None
        if resume_from and source:
            check_resume(source, self.parts.drafter_config)
        weights = load_weights(source, self.parts.drafter_config.num_hidden_layers, masters=True) if source else None
        reset_weights(self.replicas, job.seed, weights)
        gamma = job.loss_gamma if job.loss_gamma is not None else self.parts.gamma
        self.drafters.begin_job(job, gamma, self.per_step, self.context.config.recipe)
        return self._resume(resume_from) if resume_from else 0

    def _resume(self, resume_from: str) -> int:
        """The optimizer state and RNG of a checkpoint; the step it was written after."""
        state = load_training_state(resume_from)
        if state is None:
            raise JobError(f"{resume_from}: no training state to resume from")
        self.drafters.load_optimizer(state["optimizer"])
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        self.cb.on_event("resumed", {"from": str(resume_from), "step": int(state["step"])})
        saved = int(state.get("replicas", len(self.replicas))) * int(state.get("grad_accum", self.job.grad_accum))
        if saved != self.per_step:
            self.cb.on_event(
                "resume_data_order_changed",
                {
                    "message": f"the checkpoint was written with {saved} micro-batches per step, this engine runs "
                    f"{self.per_step}: training continues, but not on the data order of the first run"
                },
            )
        return int(state["step"])


class DataProgress:
    """Reports a job's data preparation at most every DATA_PROGRESS_SECONDS (and when done)."""

    def __init__(self, cb: JobCallbacks):
        self.cb = cb
        self.reported = 0.0

    def __call__(self, p: PrepareProgress) -> None:
        now = time.monotonic()
        done = p.files_done == p.files_total
        if not (done or now - self.reported >= DATA_PROGRESS_SECONDS):
            return
        self.reported = now
        self.cb.on_data_progress(
            {
                "files_total": p.files_total,
                "files_done": p.files_done,
                "files_cached": p.files_cached,
                "bytes_total": p.bytes_total,
                "bytes_done": p.bytes_done,
                "fraction": round(p.fraction, 4),
                "documents": p.documents,
                "tokens": p.tokens,
                "seconds": round(p.seconds, 3),
                "done": done,
                **({"rebuilt_cache_entries": p.rebuilt} if p.rebuilt else {}),
            }
        )
