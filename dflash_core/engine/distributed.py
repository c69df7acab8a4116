"""Training across hosts: one engine process per host in a torch.distributed group.

Launch. torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT) starts one daemon per host. Every rank builds and warms its own engine by the usual
sequential rule; the ranks meet in `init_process_group` first, so a rank that never comes is a
start-up failure, not a hang in the middle of a job.

Two channels.
  - The rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT, which torchrun's agent or rank 0
    hosts) carries what is not lock-step: each rank's readiness and its description (drafter
    count, shapes, architecture), a heartbeat counter per rank, and rank 0's job commands. Keys
    live under a prefix drawn by rank 0 at every start, so a restarted group never reads a
    previous group's keys.
  - Collectives carry the training: per step one small all-reduce on a gloo group (stop votes,
    failures, the step's statistics: CPU tensors whatever the devices), then the gradient
    all-reduce on the default group (NCCL on CUDA, gloo on CPU: GradSync), and at every
    checkpoint a control all-reduce of weight checksums. Because the control all-reduce comes
    first (after this host's gradients are summed), a rank that fails inside its step tells the
    others there instead of leaving them in the gradient all-reduce, and a dead peer is mostly
    seen on gloo, which raises, rather than on NCCL, whose watchdog may take the process down.

Loss of a rank. A collective that fails (peer gone: at once; peer hung: after `timeout_seconds`)
marks the group broken: the job fails with `resumable` set, rank 0 keeps serving and reports the
group as failed, and the job continues from its last checkpoint once the group is started again.
A rank whose heartbeat stops for HEARTBEAT_TIMEOUT_SECONDS while no collective runs is lost too.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch

from .api import JobError
from .launch import Launch

HEARTBEAT_SECONDS = 1.0
# a live process beats every second from its own thread, whatever its job does; this long
# without a beat is a dead or frozen process (a GC pause or a slow disk takes far less)
HEARTBEAT_TIMEOUT_SECONDS = 30.0
STORE_TIMEOUT_SECONDS = 10.0  # one store operation; longer means the store's host is gone
STORE_FAILURES = 3  # heartbeats in a row whose store operation failed: the store (and the group) is gone


class RankLost(JobError):
    """A collective failed: a rank died, hung or left. The group cannot train until restarted."""

    def __init__(self, message: str):
        super().__init__(message, resumable=True)


class RankGroup:
    """This process's membership in the group: the store channel, the heartbeat and the collectives."""

    def __init__(self, launch: Launch, timeout_seconds: float):
        self.launch = launch
        self.rank = launch.rank
        self.world = launch.world
        self.timeout_seconds = timeout_seconds
        self.broken: str | None = None  # why the group can no longer train (None while it can)
        self.backend: str | None = None
        self._grad_group: Any = None
        self._control: Any = None
        self._prefix = ""
        self._local = threading.local()
        self._lock = threading.Lock()
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (last counter, monotonic time it moved)
        self._ready: dict[int, dict[str, Any]] = {}  # rank -> what it announced when warm
        self._failed: dict[int, str] = {}  # rank -> why its build failed
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None
        self._seq = 0  # the next job command's number

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def grad_group(self) -> Any:
        return self._grad_group

    # ------------------------------------------------------------------ joining
    def join(self, backend: str) -> RankGroup:
        """init_process_group (blocks until every rank arrived or the timeout passed), the gloo
        control group, the store prefix of this start, and the heartbeat thread."""
        import torch.distributed as dist

        timeout = timedelta(seconds=self.timeout_seconds)
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=self.rank, world_size=self.world, timeout=timeout)
        self.backend = dist.get_backend()
        self._grad_group = dist.group.WORLD
        # a group of its own even on gloo: a control all-reduce that meets another collective (a rank
        # that failed before the gradient all-reduce) then waits for the timeout instead of
        # mixing two collectives' data on one communicator
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        nonce = torch.tensor([secrets.randbits(62) if self.is_leader else 0], dtype=torch.int64)
        dist.broadcast(nonce, 0, group=self._control)
        self._prefix = f"dflash/{int(nonce)}/"
        self._beat()
        self._heart = threading.Thread(target=self._heartbeat, name=f"rank-{self.rank}-heartbeat", daemon=True)
        self._heart.start()
        return self

    def _store(self) -> Any:
        """This thread's own client of the rendezvous store (a client serves one thread at a time)."""
        store = getattr(self._local, "store", None)
        if store is None:
            import torch.distributed as dist

            base = dist.TCPStore(
                self.launch.master_addr,
                self.launch.master_port,
                is_master=False,
                timeout=timedelta(seconds=STORE_TIMEOUT_SECONDS),
                wait_for_workers=False,
            )
            store = self._local.store = dist.PrefixStore(self._prefix, base)
        return store

    # ------------------------------------------------------------------ heartbeat and readiness
    def _beat(self) -> None:
        self._store().add(f"beat/{self.rank}", 1)

    def _heartbeat(self) -> None:
        failures = 0
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._beat()
                self._watch()
                failures = 0
            except Exception as e:  # noqa: BLE001 - a blip is retried; a store gone for good is the group gone
                failures += 1
                if failures >= STORE_FAILURES:
                    self.mark_broken(
                        f"the group's store at {self.launch.master_addr}:{self.launch.master_port} stopped "
                        f"answering ({type(e).__name__}: {e})"
                    )
                    return

    def _watch(self) -> None:
        """Read the other ranks' beats, and (on rank 0) their readiness and failures."""
        store = self._store()
        now = time.monotonic()
        watched = range(self.world) if self.is_leader else (0,)
        for r in watched:
            if r == self.rank:
                continue
            count = store.add(f"beat/{r}", 0)
            with self._lock:
                last = self._beats.get(r)
                if last is None or last[0] != count:
                    self._beats[r] = (count, now)
            if self.is_leader and r not in self._ready and store.check([f"ready/{r}"]):
                info = json.loads(store.get(f"ready/{r}"))
                with self._lock:
                    self._ready[r] = info
            if self.is_leader and r not in self._failed and store.check([f"failed/{r}"]):
                with self._lock:
                    self._failed[r] = store.get(f"failed/{r}").decode(errors="replace")
        if not self.is_leader and self.broken is None and store.check(["broken"]):
            self.mark_broken(f"rank 0: {store.get('broken').decode(errors='replace')}")
        for r, (count, moved) in list(self._beats.items()):
            if count > 0 and now - moved > HEARTBEAT_TIMEOUT_SECONDS:
                self.mark_broken(f"rank {r} stopped answering (no heartbeat for {now - moved:.0f} s)")

    def alive(self, rank: int) -> bool:
        """Whether `rank`'s heartbeat moved recently (always True for this rank)."""
        if rank == self.rank:
            return True
        with self._lock:
            last = self._beats.get(rank)
        return last is not None and time.monotonic() - last[1] <= HEARTBEAT_TIMEOUT_SECONDS

    def announce_ready(self, info: dict[str, Any]) -> None:
        """Tell rank 0 this rank is warm, with what it must agree on (drafter count, shapes)."""
        with self._lock:
            self._ready[self.rank] = info
        self._store().set(f"ready/{self.rank}", json.dumps(info, sort_keys=True))

    def announce_failed(self, error: str) -> None:
        # the group may be gone already: the rank's own health says why it failed
        with contextlib.suppress(Exception):
            self._store().set(f"failed/{self.rank}", error[:4000])

    def ranks_ready(self) -> int:
        """Ranks that are warm and beating (rank 0's view; on other ranks: this rank only)."""
        with self._lock:
            ready = list(self._ready)
        return sum(1 for r in ready if self.alive(r))

    def problem(self) -> str | None:
        """Why the group cannot train, if it cannot: a broken group, a rank whose build failed,
        ranks that disagree on what they warmed."""
        if self.broken is not None:
            return self.broken
        with self._lock:
            failed = dict(self._failed)
            ready = dict(self._ready)
        if failed:
            r = min(failed)
            return f"rank {r} failed to start: {failed[r]}"
        mine = ready.get(self.rank)
        if mine is not None:
            for r, info in sorted(ready.items()):
                diff = sorted(k for k in set(mine) | set(info) if mine.get(k) != info.get(k))
                if diff:
                    return (
                        f"rank {r} warmed a different engine than rank {self.rank} ({', '.join(diff)} differ): every "
                        "rank needs the same drafter count, shapes and target architecture"
                    )
        return None

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            if self.is_leader:  # the other ranks watch rank 0's verdict: they leave and are started again
                with contextlib.suppress(Exception):
                    self._store().set("broken", reason[:4000])

    # ------------------------------------------------------------------ job commands (store)
    def post(self, command: dict[str, Any]) -> None:
        """Rank 0: the next command for every other rank (a job to run, or shutdown)."""
        assert self.is_leader
        self._store().set(f"cmd/{self._seq}", json.dumps(command))
        self._seq += 1

    def next_command(self, stop: threading.Event, poll: float = 0.1) -> dict[str, Any] | None:
        """Other ranks: wait for rank 0's next command; None when `stop` is set or rank 0 is lost."""
        key = f"cmd/{self._seq}"
        while not stop.is_set():
            if self.broken is not None:
                return None
            try:
                if self._store().check([key]):
                    self._seq += 1
                    return json.loads(self._store().get(key))
            except Exception as e:  # noqa: BLE001 - the store went with rank 0's host
                self.mark_broken(f"the group's store stopped answering ({type(e).__name__}: {e})")
                return None
            stop.wait(poll)
        return None

    def report_error(self, command: int, message: str) -> None:
        """A rank's failure in job command `command`, for rank 0's message to the user."""
        with contextlib.suppress(Exception):  # the vote still carries the failure; only the text is lost
            self._store().set(f"error/{command}/{self.rank}", message[:4000])

    def errors_of(self, command: int) -> dict[int, str]:
        out = {}
        for r in range(self.world):
            try:
                if self._store().check([f"error/{command}/{r}"]):
                    out[r] = self._store().get(f"error/{command}/{r}").decode(errors="replace")
            except Exception:  # noqa: BLE001
                break
        return out

    def agree(
        self, values: list[int], what: str, poll: float = 0.2, on_wait: Callable[[], None] | None = None
    ) -> list[list[int]]:
        """Every rank's `values` for the current command, through the store: waits as long as the
        ranks live (their heartbeats), not a collective's timeout, because a rank may take hours
        to tokenize what another finds in its cache."""
        command = self.command_number
        store = self._store()
        store.set(f"agree/{command}/{self.rank}", json.dumps(values))
        keys = [f"agree/{command}/{r}" for r in range(self.world)]
        while True:
            if self.broken is not None:
                raise RankLost(f"{what}: {self.broken}")
            try:
                if store.check(keys):
                    return [json.loads(store.get(k)) for k in keys]
            except Exception as e:  # noqa: BLE001 - the store's host is gone
                self.mark_broken(f"the group's store stopped answering ({type(e).__name__}: {e})")
                continue
            if on_wait is not None:
                on_wait()
            time.sleep(poll)

    def signal_stop(self) -> None:
        """Rank 0: the current job stops (the others may still be preparing its data)."""
        with contextlib.suppress(Exception):
            self._store().set(f"stop/{self.command_number}", "1")

    def stop_signalled(self) -> bool:
        """Rank 0 stopped the current job (or the group broke): preparing its data can end."""
        if self.broken is not None:
            return True
        now = time.monotonic()
        if now - getattr(self._local, "stop_checked", 0.0) < 0.5:
            return False
        self._local.stop_checked = now
        try:
            return bool(self._store().check([f"stop/{self.command_number}"]))
        except Exception:  # noqa: BLE001 - a lost store breaks the group; the heartbeat reports it
            return False

    @property
    def command_number(self) -> int:
        """The number of the command being run (the last one posted or received)."""
        return self._seq - 1

    # ------------------------------------------------------------------ collectives
    def guarded(self, what: str, call: Callable[[], Any]) -> Any:
        """Run a collective; its failure breaks the group and becomes RankLost (resumable)."""
        if self.broken is not None:
            raise RankLost(f"{self.broken}; restart the group to continue")
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - gloo and NCCL raise RuntimeError or DistError subclasses
            # the first sentence of the backend's message (gloo's goes on with advice and an emoji)
            detail = (str(e).splitlines() or [""])[0].split(". ")[0][:300]
            self.mark_broken(f"{what} failed: {self._who_is_gone()}{type(e).__name__}: {detail}")
            raise RankLost(
                f"{self.broken}; the job continues from its last checkpoint when every rank is started again"
            ) from e

    def _who_is_gone(self) -> str:
        """Ranks whose heartbeat stops within a few beats of a failed collective (best effort)."""
        deadline = time.monotonic() + 3 * HEARTBEAT_SECONDS
        store_ok = True
        while time.monotonic() < deadline:
            time.sleep(HEARTBEAT_SECONDS)
            try:
                self._watch()
            except Exception:  # noqa: BLE001
                store_ok = False
                break
        if not store_ok:
            return "the group's store is gone too; "
        now = time.monotonic()
        with self._lock:
            stale = sorted(r for r, (_, moved) in self._beats.items() if now - moved >= 2 * HEARTBEAT_SECONDS)
        return f"rank(s) {', '.join(map(str, stale))} stopped beating; " if stale else ""

    def all_sum(self, values: torch.Tensor, what: str = "the step's control all-reduce") -> torch.Tensor:
        """Element-wise sum over the ranks of a float64 CPU vector (control group)."""
        import torch.distributed as dist

        out = values.to(torch.float64).clone()
        self.guarded(what, lambda: dist.all_reduce(out, group=self._control))
        return out

    def broadcast_json(self, obj: Any, what: str) -> Any:
        """Rank 0's JSON-able `obj` on every rank (other ranks pass None)."""
        import torch.distributed as dist

        data = json.dumps(obj).encode() if self.is_leader else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.guarded(what, lambda: dist.broadcast(size, 0, group=self._control))
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.is_leader
            else torch.empty(int(size), dtype=torch.uint8)
        )
        self.guarded(what, lambda: dist.broadcast(buf, 0, group=self._control))
        return json.loads(bytes(buf.tolist())) if not self.is_leader else obj

    def broadcast_tensors(self, tensors: list[torch.Tensor], device: torch.device, what: str) -> None:
        """Rank 0's values into `tensors` on every rank, in place, over the gradient group
        (NCCL moves CUDA tensors only: CPU tensors travel through `device`)."""
        import torch.distributed as dist

        for t in tensors:
            staged = t.to(device) if self.backend == "nccl" and t.device.type != "cuda" else t

            def send(x: torch.Tensor = staged) -> None:
                dist.broadcast(x, 0, group=self._grad_group)

            self.guarded(what, send)
            if staged is not t:
                t.copy_(staged)

    # ------------------------------------------------------------------ leaving
    def close(self) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join(timeout=2 * HEARTBEAT_SECONDS)


# ---------------------------------------------------------------------- nested state over the wire
def flatten_state(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """A JSON skeleton of `obj` (dicts, lists, tuples, numbers, strings, None) with every tensor
    replaced by a reference into the returned list. Dict keys keep their type (optimizer state
    dicts are keyed by int), so the skeleton is not a plain JSON object; `unflatten_state` undoes it."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {
                "t": len(tensors) - 1,
                "shape": list(x.shape),
                "dtype": str(x.dtype).removeprefix("torch."),
                "cuda": x.device.type == "cuda",
            }
        if isinstance(x, dict):
            return {"d": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"l" if isinstance(x, list) else "u": [walk(v) for v in x]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        raise TypeError(f"cannot send a {type(x).__name__} to the other ranks")

    return walk(obj), tensors


def empty_tensors(skeleton: Any, device: torch.device) -> list[torch.Tensor]:
    """Tensors shaped like the skeleton's references, on `device` where the sender's were on CUDA."""
    found: dict[int, torch.Tensor] = {}

    def walk(x: Any) -> None:
        if "t" in x:
            dev = device if x["cuda"] else torch.device("cpu")
            found[x["t"]] = torch.empty(x["shape"], dtype=getattr(torch, x["dtype"]), device=dev)
        elif "d" in x:
            for k, v in x["d"]:
                walk(k)
                walk(v)
        elif "l" in x or "u" in x:
            for v in x.get("l", x.get("u")):
                walk(v)

    walk(skeleton)
    return [found[i] for i in range(len(found))]


def unflatten_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if "t" in skeleton:
        return tensors[skeleton["t"]]
    if "d" in skeleton:
        return {unflatten_state(k, tensors): unflatten_state(v, tensors) for k, v in skeleton["d"]}
    if "l" in skeleton:
        return [unflatten_state(v, tensors) for v in skeleton["l"]]
    if "u" in skeleton:
        return tuple(unflatten_state(v, tensors) for v in skeleton["u"])
    return skeleton["v"]


CHECKSUM_CHUNK = 1 << 22  # elements per step of the checksum (bounds its temporary memory)


@torch.no_grad()
def weights_checksum(tensors: Iterable[torch.Tensor]) -> int:
    """A fingerprint of tensors' bits: each element's bits as an integer, weighted by its position
    (swapped or offsetting changes show), summed with int64 wrap-around; bit-identical replicas
    give equal values. One host sync per device; temporaries of CHECKSUM_CHUNK elements."""
    words = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    totals: dict[torch.device, torch.Tensor] = {}
    weights: dict[torch.device, torch.Tensor] = {}
    offset = 0
    for t in tensors:
        flat = t.detach().contiguous().view(-1).view(words[t.element_size()])
        if t.device not in weights:
            weights[t.device] = torch.arange(1, CHECKSUM_CHUNK + 1, dtype=torch.int64, device=t.device)
            totals[t.device] = torch.zeros((), dtype=torch.int64, device=t.device)
        for i in range(0, flat.numel(), CHECKSUM_CHUNK):
            chunk = flat[i : i + CHECKSUM_CHUNK].to(torch.int64)
            totals[t.device] += (chunk * (weights[t.device][: chunk.numel()] + (offset + i) % 1_000_003)).sum()
        offset += flat.numel()
    return sum(int(v) for v in totals.values()) % (1 << 63)
