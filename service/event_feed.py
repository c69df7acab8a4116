"""Followed event streams (GET /jobs/{id}/events?follow=true) served from one poller per job.

Each followed job has one feed: a task that reads the job's state and its new events from the store
every FOLLOW_POLL_SECONDS, keeps the newest of them (rendered once) in memory and wakes the
followers. Followers read the store themselves only to catch up on history older than the feed
holds, once. The store has one connection behind one lock, shared with the training thread's
per-step writes, so its reads must not grow with the number of followers; the number of open
streams is bounded by `max_event_streams` as well (HTTP 429 beyond it).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from .jobs.store import EventRecord, JobStore

log = logging.getLogger("dflash.service")

EVENT_PAGE = 500
FOLLOW_POLL_SECONDS = 0.25
FEED_WINDOW = 4096  # events a feed keeps for its followers; one further behind reads the store


class TooManyStreams(Exception):
    pass


@dataclass(frozen=True)
class _Line:
    id: int
    kind: str
    text: str


class _Feed:
    def __init__(self, hub: EventHub, job_id: str, start_after: int):
        self.hub = hub
        self.job_id = job_id
        self.base = start_after  # events up to here are not held: a follower behind it reads the store
        self.last = start_after  # the newest event id read
        self.ids: list[int] = []
        self.lines: list[_Line] = []
        self.ended = False  # the job ended (or the daemon stops) and every event was read
        self.closed = False  # the poller stopped: a new follower needs a new feed
        self.followers = 0
        self._changed = asyncio.Event()
        self.task: asyncio.Task | None = None

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_beyond(self, last: int) -> None:
        if self.last > last or self.ended:
            return
        await self._changed.wait()

    def _append(self, events: list[EventRecord]) -> None:
        for event in events:
            self.ids.append(event.id)
            self.lines.append(_Line(event.id, event.kind, self.hub.render(event)))
        if events:
            self.last = events[-1].id
        excess = len(self.lines) - FEED_WINDOW
        if excess > 0:
            self.base = self.ids[excess - 1]
            del self.ids[:excess], self.lines[:excess]

    def held_after(self, last: int) -> tuple[list[_Line], int]:
        """The held events after `last`, and the id up to which they are complete."""
        return self.lines[bisect.bisect_right(self.ids, last) :], self.last

    async def run(self) -> None:
        store = self.hub.store
        try:
            while self.followers > 0:
                job = await self.hub.read(store.get_job, self.job_id, with_checkpoints=False)
                ended = job is None or job.terminal  # read before draining: no event is missed
                while True:
                    page = await self.hub.read(store.events, self.job_id, after=self.last, limit=EVENT_PAGE)
                    self._append(page)
                    if page:
                        self._notify()
                    if len(page) < EVENT_PAGE:
                        break
                if ended or self.hub.stopping():
                    self.ended = True
                    self._notify()
                    return
                await asyncio.sleep(FOLLOW_POLL_SECONDS)
        except Exception:  # noqa: BLE001 - logged; the streams end instead of waiting forever
            log.exception("event feed of job %s failed", self.job_id)
        finally:
            self.closed = True
            self.ended = True  # a poller that failed ends its streams rather than leaving them waiting
            self._notify()
            if self.hub.feeds.get(self.job_id) is self:
                del self.hub.feeds[self.job_id]


class EventHub:
    """The feeds of followed jobs and the count of open streams (asyncio, the event loop's thread)."""

    def __init__(
        self,
        store: JobStore,
        render: Callable[[EventRecord], str],
        *,
        max_streams: int,
        stopping: Callable[[], bool],
    ):
        self.store = store
        self.render = render
        self.max_streams = max_streams
        self.stopping = stopping
        self.feeds: dict[str, _Feed] = {}
        self.open_streams = 0
        self.store_reads = 0  # store queries made for followed streams (feeds and catch-ups)

    async def read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.store_reads += 1
        return await run_in_threadpool(fn, *args, **kwargs)

    def open(self) -> None:
        """Reserve a stream; TooManyStreams when max_streams are open."""
        if self.open_streams >= self.max_streams:
            raise TooManyStreams(f"{self.open_streams} event streams are open; at most {self.max_streams} are served")
        self.open_streams += 1

    def close(self) -> None:
        self.open_streams -= 1

    async def follow(self, job_id: str, *, after: int, kinds: list[str] | None) -> AsyncIterator[str]:
        """NDJSON lines of the job's events after `after` until the job ends (or the daemon stops)."""
        feed = self.feeds.get(job_id)
        if feed is None or feed.closed:
            feed = self.feeds[job_id] = _Feed(self, job_id, after)
            feed.task = asyncio.create_task(feed.run(), name=f"event feed {job_id}")
        feed.followers += 1
        wanted = set(kinds) if kinds else None
        last = after
        try:
            while True:
                if last < feed.base:  # older than the feed holds: from the store, once
                    base = feed.base
                    page = await self.read(self.store.events, job_id, after=last, kinds=kinds, limit=EVENT_PAGE)
                    for event in page:
                        last = event.id
                        yield self.render(event)
                    if len(page) < EVENT_PAGE:
                        last = max(last, base)  # every matching event up to `base` was in that page
                    continue
                held, complete = feed.held_after(last)
                for line in held:
                    if wanted is None or line.kind in wanted:
                        yield line.text
                last = max(last, complete)
                if feed.ended and last >= feed.last:
                    return
                await feed.wait_beyond(last)
        finally:
            feed.followers -= 1
