"""The rank protocol: everything a job says to the other ranks, behind one set of methods.

`SoloRanks` is one process; `GroupRanks` is this process's place in a multi-host group, over the
transport in distributed.py (`RankGroup`: the store, the heartbeat, the collectives). Both answer
the same calls, in the order a job makes them, so the engine and the job loop never ask which
one they hold:

  join / bind / announce_ready   the build: meet the group, hand it the drafters, say "warm"
  check_can_run / send_job       a job on rank 0: the group can take it, the others get it
  agree_start                    every rank prepared the job (or why not) and read the same data
  share_start                    rank 0's weights, optimizer state and first step on every rank
  stops_before_step              a cancel seen before a step (one process stops at once, a group
                                 votes it in the step's exchange)
  exchange_step                  this rank's failure or statistics summed with every rank's
  check_weights                  every rank holds the same weights (before rank 0 checkpoints)
  voting()                       a failure between collectives goes out in the collective the
                                 others wait in
  agree_end / after_job          every rank past the job's end; a peer that left breaks the group
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from ..data.prepare import PrepareCancelled
from ..kinds import job_from_dict
from .api import JobError
from .distributed import RankGroup, RankLost, empty_tensors, flatten_state, unflatten_state, weights_checksum
from .drafters import Drafters
from .optim import load_optimizer_state
from .replica import StepAccumulator
from .warmup import Timeline

# why a step ended the job early: rank 0's cancel, or another rank shutting down
CANCEL, SHUTDOWN = "cancel", "shutdown"


class PeerFailed(JobError):
    """Another rank reported a failure in a collective: this rank stops without voting again."""


class Prepared(Protocol):
    start: int

    def fingerprint(self) -> list[int]:
        """What every rank must have read alike (micro-batches per epoch, tokens, steps)."""
        ...


P = TypeVar("P", bound=Prepared)


def failure_text(error: BaseException) -> str:
    return error.message if isinstance(error, JobError) else f"{type(error).__name__}: {error}"


def first_failure(futures: list[cf.Future], local_error: BaseException | None) -> BaseException | None:
    return next((e for f in futures if (e := f.exception()) is not None), local_error)


class SoloRanks:
    """One process: rank 0 of 1. Nothing to agree on; a failure is the job's at once."""

    rank, world, leads = 0, 1, True

    def join(self, drafter_devices: list[str], timeline: Timeline) -> None: ...
    def bind(self, drafters: Drafters, block_size: int) -> None: ...
    def announce_ready(self, description: Callable[[], dict[str, Any]]) -> None: ...
    def announce_failed(self, error: BaseException) -> None: ...
    def check_can_run(self) -> None: ...
    def send_job(self, job: Any, resume_from: str | None) -> None: ...

    def status(self, ready: bool) -> dict[str, Any]:
        return {"rank": 0, "ranks_total": 1, "ranks_ready": int(ready), "group_problem": None}

    def stop_signalled(self) -> bool:
        return False

    def agree_start(self, attempt: Callable[[], P], cancelled: Callable[[], bool]) -> P | None:
        try:
            return attempt()
        except PrepareCancelled:
            return None

    def share_start(self, start: int) -> int:
        return start

    def stops_before_step(self, cancel: bool) -> bool:
        return cancel

    def exchange_step(
        self, futures: list[cf.Future], local_error: BaseException | None, cancel: bool
    ) -> tuple[StepAccumulator | None, str | None]:
        """Raises the step's failure; else no totals (this process's own are the job's) and no stop."""
        if (error := first_failure(futures, local_error)) is not None:
            raise error
        return None, None

    def check_weights(self, step: int, due: bool) -> None: ...

    @contextlib.contextmanager
    def voting(self) -> Iterator[None]:
        yield

    def agree_end(self) -> None: ...
    def after_job(self, stop: str | None, step: int) -> None: ...


class Control:
    """The per-step control vector the ranks sum (float64, exact for the counts and the 52-bit
    checksums it carries): stop votes, failures, the step's statistics, one checksum per rank."""

    CANCEL, SHUTDOWN, FAILED, LOSS, MICRO, TOKENS = range(6)

    def __init__(self, block_size: int, world: int):
        self.block, self.world = block_size, world
        self.size = 6 + 2 * block_size + world

    def new(self, failed: bool = False) -> torch.Tensor:
        v = torch.zeros(self.size, dtype=torch.float64)
        v[self.FAILED] = float(failed)
        return v

    def pack(self, v: torch.Tensor, totals: StepAccumulator) -> None:
        v[self.LOSS], v[self.MICRO], v[self.TOKENS] = (
            float(totals.loss_sum),
            totals.micro_batches,
            totals.context_tokens,
        )
        v[6 : 6 + self.block] = totals.correct.double()
        v[6 + self.block : 6 + 2 * self.block] = totals.counted.double()

    def unpack(self, v: torch.Tensor) -> StepAccumulator:
        return StepAccumulator(
            v[self.LOSS].clone(),
            v[6 : 6 + self.block].float(),
            v[6 + self.block : 6 + 2 * self.block].float(),
            int(v[self.TOKENS]),
            int(v[self.MICRO]),
        )

    def checksums(self, v: torch.Tensor) -> torch.Tensor:
        return v[6 + 2 * self.block :]


class GroupRanks:
    """This process's rank in a multi-host group: rank 0 takes jobs and sends them; per step the
    ranks sum one control vector (votes, failures, statistics) before the gradient all-reduce."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.rank, self.world, self.leads = group.rank, group.world, group.is_leader
        self.drafters: Drafters | None = None
        self.control = Control(1, group.world)
        # rank 0's optimizer state, flattened while the job prepares (sent by share_start)
        self.optimizer_state: tuple[Any, list[torch.Tensor]] = (None, [])

    # ------------------------------------------------------------------ build
    def join(self, drafter_devices: list[str], timeline: Timeline) -> None:
        timeline.enter("joining_group")
        self.group.join("nccl" if any(d.startswith("cuda") for d in drafter_devices) else "gloo")
        timeline.mark("build:group_joined")

    def bind(self, drafters: Drafters, block_size: int) -> None:
        """Only after warm-up: each rank warms on its own time (a cold cache, a slow disk), so
        warm-up's exercise of the gradient sync stays on this host."""
        self.drafters, self.control = drafters, Control(block_size, self.world)
        drafters.grad_sync.process_group = self.group.grad_group
        drafters.grad_sync.guard = self.group.guarded

    def announce_ready(self, description: Callable[[], dict[str, Any]]) -> None:
        self.group.announce_ready(description())

    def announce_failed(self, error: BaseException) -> None:
        if self.group.backend is not None:
            self.group.announce_failed(f"{type(error).__name__}: {error}")

    def status(self, ready: bool) -> dict[str, Any]:
        group = self.group
        return {
            "rank": group.rank,
            "ranks_total": group.world,
            "ranks_ready": group.ranks_ready() if self.leads else int(ready),
            "group_problem": group.problem(),
        }

    # ------------------------------------------------------------------ jobs in and out
    def check_can_run(self) -> None:
        group = self.group
        if not self.leads:
            raise JobError(f"rank {group.rank} runs the jobs rank 0 sends; submit jobs to rank 0")
        if (problem := group.problem()) is not None:
            raise JobError(f"the group cannot train: {problem}", resumable=group.broken is not None)
        if group.ranks_ready() < group.world:
            raise JobError(f"{group.ranks_ready()} of {group.world} ranks are ready", resumable=True)

    def send_job(self, job: Any, resume_from: str | None) -> None:
        self.group.post({"kind": "run", "job": job.to_dict(), "resume_from": resume_from})

    def next_command(self, stop: Any) -> dict[str, Any] | str:
        """Ranks other than 0: rank 0's next job command, or why following ends."""
        command = self.group.next_command(stop)
        if command is None:
            return self.group.broken or "stopped"
        if command.get("kind") == "shutdown":
            return "rank 0 shut the group down"
        return command

    def read_job(self, command: dict[str, Any]) -> Any:
        """The job in rank 0's command; a job this rank cannot read (a field of a newer rank 0)
        fails readably on every rank, in the start agreement the others wait in."""
        try:
            return job_from_dict(command["job"])
        except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
            message = f"rank {self.rank} cannot read the job rank 0 sent ({type(e).__name__}: {e})"
            self.group.report_error(self.group.command_number, message)
            self.group.agree([2, 0, 0, 0], "the job's start")
            raise JobError(message) from None

    def stop_signalled(self) -> bool:
        return self.group.stop_signalled()

    # ------------------------------------------------------------------ the start
    def agree_start(self, attempt: Callable[[], P], cancelled: Callable[[], bool]) -> P | None:
        """Every rank prepares its own copy of the data, then the ranks agree that all of them
        succeeded and read the same data; None when the job was stopped while preparing."""
        group = self.group
        failure: BaseException | None = None
        prepared: P | None = None
        stopped = False
        try:
            prepared = attempt()
            if self.leads:  # flattened now: a failure to do so is reported like any other
                self.optimizer_state = flatten_state(self._first().optimizer.state_dict())
        except PrepareCancelled:
            stopped = True
        except BaseException as e:  # noqa: BLE001 - agreed on below, then raised on every rank
            failure = e
            group.report_error(group.command_number, failure_text(e))
        # 1: rank 0 stopped (a cancel, or its shutdown); 2: failed; 3: another rank shuts down
        outcome = 2 if failure is not None else (1 if self.leads else 3) if stopped else 0
        mine = [outcome, *(prepared.fingerprint() if prepared is not None else [0, 0, 0])]
        if outcome != 0 and self.leads:
            group.signal_stop()  # the others need not finish preparing a job that will not run

        def leader_cancels() -> None:  # rank 0 waiting for a slower rank still takes a cancel
            if self.leads and cancelled():
                group.signal_stop()

        views = group.agree(mine, "the job's start", on_wait=leader_cancels)
        self._check_views(views, failure)
        if any(v[0] == 1 for v in views):
            return None
        assert prepared is not None
        return prepared

    def _check_views(self, views: list[list[int]], failure: BaseException | None) -> None:
        group = self.group
        if failed := [r for r, v in enumerate(views) if v[0] == 2]:
            if failure is not None:
                raise failure
            errors = group.errors_of(group.command_number)
            raise PeerFailed("; ".join(f"rank {r}: {errors.get(r, 'failed to prepare the job')}" for r in failed))
        if leaving := [r for r, v in enumerate(views) if v[0] == 3]:
            group.mark_broken(f"rank(s) {', '.join(map(str, leaving))} shut down (they left the group)")
            raise JobError(
                f"rank(s) {', '.join(map(str, leaving))} shut down while the job prepared its data; it starts "
                "when every rank is started again",
                resumable=True,
            )
        if any(v[0] == 1 for v in views):
            return
        if differ := [r for r, v in enumerate(views) if v[1:] != views[0][1:]]:
            raise JobError(
                f"rank(s) {', '.join(map(str, differ))} read different data than rank 0 (micro-batches per epoch, "
                f"tokens, steps: {[views[0][1:]] + [views[r][1:] for r in differ]}): every host needs the same "
                "dataset files at the same paths",
                "datasets",
            )

    def share_start(self, start: int) -> int:
        """Rank 0's weights, optimizer state (flattened before the ranks agreed to start) and first
        step on every rank (a resume or init_from is read by rank 0 only: the other hosts need not
        see its output directory); then one control all-reduce in which a rank that could not
        load them says so."""
        group, first = self.group, self._first()
        skeleton, tensors = self.optimizer_state
        meta = group.broadcast_json({"start": start, "optimizer": skeleton}, "sending the start state")
        with torch.no_grad():
            group.broadcast_tensors([m for _, m in first.named_masters()], first.device, "sending the start weights")
        error: BaseException | None = None
        if not self.leads:
            try:
                tensors = empty_tensors(meta["optimizer"], first.device)
            except Exception as e:  # noqa: BLE001 - this host is out of memory: the broadcast below goes
                # without this rank, so the others see it only at the collective timeout (then a lost rank)
                error, tensors = e, []
        if error is None:
            group.broadcast_tensors(tensors, first.device, "sending the optimizer state")
        if not self.leads and error is None:
            try:
                self._load_start(unflatten_state(meta["optimizer"], tensors))
            except Exception as e:  # noqa: BLE001 - voted below
                error = e
        self.optimizer_state = (None, [])
        if error is not None:
            group.report_error(group.command_number, f"loading rank 0's start state: {failure_text(error)}")
        self._all_sum(self.control.new(failed=error is not None), "loading the start state")
        if error is not None:
            error._voted = True  # type: ignore[attr-defined]
            raise error
        return int(meta["start"])

    def _load_start(self, optimizer_state: Any) -> None:
        """Rank 0's weights (already in the first replica's masters) and optimizer state into every replica."""
        assert self.drafters is not None
        first = self._first()
        first.load_state(first.weights_state())  # refreshes the bf16 working copies from the masters
        weights = first.weights_state()
        for rep in self.drafters.replicas:
            if rep is not first:
                rep.load_state(weights)
            assert rep.optimizer is not None
            load_optimizer_state(rep.optimizer, optimizer_state if rep is first else copy.deepcopy(optimizer_state))

    def _first(self) -> Any:
        assert self.drafters is not None, "bind() first"
        return self.drafters.replicas[0]

    # ------------------------------------------------------------------ steps
    def stops_before_step(self, cancel: bool) -> bool:
        return False  # a cancel is voted in the step's exchange, and the step finishes on every rank

    def exchange_step(
        self, futures: list[cf.Future], local_error: BaseException | None, cancel: bool
    ) -> tuple[StepAccumulator | None, str | None]:
        """This rank's vote (stop, failure) and statistics summed with every rank's; raises this
        rank's own failure (after telling the others) or PeerFailed."""
        control, group = self.control, self.group
        error = first_failure(futures, local_error)
        vector = control.new(failed=error is not None)
        vector[Control.CANCEL if self.leads else Control.SHUTDOWN] = float(cancel)
        if error is not None:
            group.report_error(group.command_number, failure_text(error))
        else:
            control.pack(vector, StepAccumulator.merged([f.result() for f in futures]))
        votes = self._all_sum(vector, "the step's control all-reduce")
        if error is not None:
            error._voted = True  # type: ignore[attr-defined]  # voting() must not vote twice
            raise error
        stop = CANCEL if votes[Control.CANCEL] else SHUTDOWN if votes[Control.SHUTDOWN] else None
        return control.unpack(votes), stop

    def check_weights(self, step: int, due: bool) -> None:
        """Every rank's replicas hold the same weights (checked before rank 0 checkpoints them)."""
        if not due:
            return
        vector = self.control.new()
        checksum = weights_checksum(m for _, m in self._first().named_masters()) % (1 << 52)
        self.control.checksums(vector)[self.rank] = checksum
        sums = self.control.checksums(self._all_sum(vector, "comparing weights")).tolist()
        if differ := [r for r, c in enumerate(sums) if c != sums[0]]:
            raise JobError(
                f"step {step}: the weights of rank(s) {', '.join(map(str, differ))} differ from rank 0's (checksums "
                f"{[int(c) for c in sums]}); the replicas diverged, so no checkpoint was written"
            )

    def _all_sum(self, vector: torch.Tensor, what: str) -> torch.Tensor:
        """One control all-reduce; raises PeerFailed when a rank voted a failure in it."""
        group = self.group
        out = group.all_sum(vector, what)
        if out[Control.FAILED] > 0 and not vector[Control.FAILED]:
            errors = group.errors_of(group.command_number)
            text = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items())) or "a rank failed"
            raise PeerFailed(text)
        return out

    # ------------------------------------------------------------------ failures and the end
    @contextlib.contextmanager
    def voting(self) -> Iterator[None]:
        """A rank that fails between collectives sends the failure in the collective the others
        wait in (every collective after the start is a control all-reduce of the same size)."""
        group = self.group
        try:
            yield
        except BaseException as e:
            self._vote_failure(e)
            if group.broken is not None and not isinstance(e, RankLost):
                # e.g. the thread that saw the failed collective was not this one: still the group's loss
                raise RankLost(
                    f"{group.broken}; the job continues from its last checkpoint when every rank is started again"
                ) from e
            raise

    def _vote_failure(self, error: BaseException) -> None:
        group = self.group
        if group.broken is not None or isinstance(error, (PeerFailed, RankLost)) or getattr(error, "_voted", False):
            return
        group.report_error(group.command_number, failure_text(error))
        with contextlib.suppress(RankLost):  # the group is gone: nobody waits for the vote
            group.all_sum(self.control.new(failed=True), "reporting a failure")

    def agree_end(self) -> None:
        """Every rank past the end (rank 0: the last checkpoint written)."""
        self._all_sum(self.control.new(), "the job's end")

    def after_job(self, stop: str | None, step: int) -> None:
        """A rank that shut down mid-job left the group: the job continues when it is whole again."""
        if stop != SHUTDOWN:
            return
        self.group.mark_broken("a rank is shutting down (it left the group)")
        raise JobError(
            f"stopped at step {step}: a rank is shutting down; the job continues from the checkpoint of step {step} "
            "when every rank is started again",
            resumable=True,
        )


Ranks = SoloRanks | GroupRanks


def ranks_for(group: RankGroup | None) -> Ranks:
    return SoloRanks() if group is None else GroupRanks(group)
