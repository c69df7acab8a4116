"""Chunked prefill for the slot decoder (decode.SlotDecoder): prompts that ride in the decode steps.

A prefill is a forward of its own: while it runs, no slot decodes. Where most slots are decoding
and a few free up, their prompts can instead ride in the decode step as rows of their own: a
prompt token at position p of slot s is one more query of the step, its key and value written at
(s, p) with the decode rows' ones, its attention over positions 0..p of slot s's cache (the
kernel reads each query's slot from its range; a mask path gets the slot's keys gathered). A
layer writes every row's keys before any row attends, so a prompt's tokens may ride in one step
or over several, oldest prompt first, up to `rows` tokens a step. Its last token is not a riding row:
it is the slot's own decode query, in the step that carries the last of the tokens before it (the
first step, for a one-token prompt), so the slot's first generated token is that step's token,
sampled at step 0 as a prefill's would be. Until then the slot stays parked.

A riding step is recorded as a CUDA graph, so its rows are a fixed count: one of a few widths, the
widest `rows`, each of the others a quarter of the one above it (riding_widths). A step takes the
narrowest width that holds its prompt tokens, since every row costs GEMM work whether a prompt
fills it or not: a short prompt does not pay for the widest step. Rows no prompt fills are
parked, at slot 0's parked position, which no sequence reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# a freed slot's prompt rides only while at most this many steps' rows hold what is queued: a
# longer queue keeps its slots idle longer than a prefill would stop the others
_RIDE_STEPS = 4
# each riding width a quarter of the next wider one, down to a few rows: a step pays for at most
# four times the rows it fills (or the narrowest width), for a handful of recorded graphs per
# sampling mode
_WIDTH_RATIO = 4
_NARROWEST = 4


def riding_rows(slots: int, attention_kernel: bool) -> int:
    """Prompt tokens a decode step carries by default: twice the slots, at most 512, where the
    step attends through the kernel (the masked step reads the whole cache for every riding row)
    and there are two slots or more (one slot never frees beside a decoding one); else none."""
    return min(2 * slots, 512) if attention_kernel and slots > 1 else 0


def riding_widths(rows: int) -> tuple[int, ...]:
    """The riding step's widths, widest first: rows, then each a quarter of the one before while
    that is at least a few rows (none for no rows)."""
    widths = [rows] if rows > 0 else []
    while widths[-1:] and widths[-1] // _WIDTH_RATIO >= _NARROWEST:
        widths.append(widths[-1] // _WIDTH_RATIO)
    return tuple(widths)


@dataclass
class _Riding:
    slot: int
    request: Any  # decode.Request
    fed: int = 0  # prompt tokens written so far (positions 0..fed-1)


@dataclass
class RideRows:
    """One step's riding rows (each list `width` long: the narrowest width holding them, 0 for a
    step without) and the prompts whose last token is their slot's query in that step."""

    tokens: list[int]
    slots: list[int]
    positions: list[int]
    filled: int  # rows holding a prompt token; the rest are parked
    width: int
    seated: list[tuple[int, Any]]  # (slot, request)


class RideQueue:
    """Prompts waiting to ride, each bound to its slot, fed up to the widest width's tokens a step
    in arrival order; a step's rows padded to the narrowest of `widths` that holds them."""

    def __init__(self, widths: tuple[int, ...], parked: int):
        if not widths or min(widths) < 1:
            raise ValueError(f"a ride queue takes widths of at least one row a step, not {widths}")
        self.widths = tuple(sorted(widths))
        self.rows, self.parked = self.widths[-1], parked
        self._queue: deque[_Riding] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def backlog(self) -> int:
        """Prompt tokens still to ride (each prompt's last token excluded: it is its slot's query)."""
        return sum(len(r.request.prompt) - 1 - r.fed for r in self._queue)

    def add(self, slot: int, request) -> None:
        self._queue.append(_Riding(slot, request))

    def board(self, free: deque[int], pending: deque, fits: Callable[[Any], Any]) -> None:
        """Pending prompts (each checked by `fits`) into free slots, in order, while the queue
        stays within a few steps' rows; the rest wait for a prefill."""
        room = _RIDE_STEPS * self.rows - self.backlog()
        while free and pending and len(pending[0].prompt) - 1 <= room:
            request = fits(pending.popleft())
            room -= len(request.prompt) - 1
            self.add(free.popleft(), request)

    def next_rows(self) -> RideRows:
        tokens: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        seated: list[tuple[int, Any]] = []
        room = self.rows
        while self._queue:
            r = self._queue[0]
            prompt = r.request.prompt
            take = min(len(prompt) - 1 - r.fed, room)
            tokens += prompt[r.fed : r.fed + take]
            slots += [r.slot] * take
            positions += range(r.fed, r.fed + take)
            r.fed += take
            room -= take
            if r.fed < len(prompt) - 1:
                break  # the step is full; this prompt goes on next step
            seated.append((r.slot, r.request))
            self._queue.popleft()
        filled = len(tokens)
        width = next((w for w in self.widths if w >= filled), self.rows) if filled else 0
        pad = width - filled
        return RideRows(tokens + [0] * pad, slots + [0] * pad, positions + [self.parked] * pad, filled, width, seated)
