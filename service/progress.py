"""The progress line of a followed job, drawn by tqdm's formatter, with the elapsed time and the
ETA taken from the step events' own timestamps (the daemon's clock).

A follower that attaches to a running job (`logs --follow`, or `submit --follow` after a daemon
restart) first receives the job's past events in one burst: a rate measured on the follower's
clock would count a hundred steps in a few milliseconds. The events carry the time the daemon
recorded them, so the rate is the steps between two events over the time between them, over the
recent window; the ETA is the steps left at that rate."""

from __future__ import annotations

from collections import deque
from typing import Any

from tqdm import tqdm

WINDOW = 32  # step events the rate is measured over: recent enough to follow a change of pace


class StepRate:
    """Steps per second from the step events seen, and the elapsed time since the job started
    running, both on the daemon's clock."""

    def __init__(self, window: int = WINDOW):
        self._recent: deque[tuple[float, int]] = deque(maxlen=window)
        self.started: float | None = None

    def start(self, when: float) -> None:
        """The job (re)started running at `when` (a state RUNNING or resumed event)."""
        self.started = when
        self._recent.clear()  # a pause between runs is no part of the step rate

    def add(self, when: float, step: int) -> None:
        if self.started is None:
            self.started = when
        if self._recent and step <= self._recent[-1][1]:  # a resume recomputes steps: start over
            self._recent.clear()
        self._recent.append((when, step))

    def rate(self) -> float | None:
        if len(self._recent) < 2:
            return None
        (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def times(self, total: int) -> tuple[float | None, float | None]:
        """(elapsed, ETA) in seconds as of the newest step event; None where not known yet."""
        if not self._recent:
            return None, None
        when, step = self._recent[-1]
        elapsed = when - self.started if self.started is not None else None
        rate = self.rate()
        eta = max(total - step, 0) / rate if rate and total else None
        return elapsed, eta

    def observe(self, event: dict[str, Any]) -> None:
        """Feed one event of the job's stream."""
        when = event.get("time")
        if not isinstance(when, int | float):
            return
        kind = event.get("kind")
        if (kind == "state" and event.get("state") == "RUNNING") or kind == "resumed":
            self.start(float(when))
        elif kind == "step" and isinstance(event.get("step"), int):
            self.add(float(when), event["step"])


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def progress_line(event: dict[str, Any], elapsed: float | None = None, eta: float | None = None) -> str:
    """`step 109/200 [#####   ]  54.5%  loss 1.2345  12,000 tok/s  00:52 elapsed, ETA 00:38`:
    tqdm's bar and times; without elapsed, the line of a replayed log (no times)."""
    step, total = int(event.get("step") or 0), int(event.get("total_steps") or 0)
    stats = f"loss {_fmt(event.get('loss'), '.4f')}  {_fmt(event.get('tokens_per_second'), ',.0f')} tok/s"
    stats = stats.replace("{", "{{").replace("}", "}}")
    timing = "  {elapsed} elapsed, ETA {remaining}" if elapsed is not None else ""
    if total <= 0:  # not known yet: no bar, no ETA
        timing = "  {elapsed} elapsed" if elapsed is not None else ""
        return tqdm.format_meter(step, None, elapsed or 0, bar_format=f"step {{n_fmt}}/?  {stats}{timing}")
    rate = (total - step) / eta if eta else None  # tqdm derives the ETA from the rate it is given
    bar_format = f"step {{n_fmt}}/{{total_fmt}} [{{bar:24}}] {{percentage:5.1f}}%  {stats}{timing}"
    line = tqdm.format_meter(min(step, total), total, elapsed or 0, rate=rate, ascii=" #", bar_format=bar_format)
    return line if eta is not None or elapsed is None else line.replace("ETA ?", "ETA --:--")


def duration(seconds: float | None) -> str:
    """`01:23` (tqdm's format) for a time in seconds; `--:--` where it is not known."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "--:--"
    return tqdm.format_interval(seconds)
