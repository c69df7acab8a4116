"""Followed event streams (GET /jobs/{id}/events?follow=true) served from one poller per job.

Each followed job has one feed: a task that reads the job's state and its new events from the store
every FOLLOW_POLL_SECONDS, keeps the newest of them (rendered and encoded once) in memory and wakes
the followers. Followers read the store themselves only to catch up on history older than the feed
holds, once. The store has one connection behind one lock, shared with the training thread's
per-step writes, so its reads must not grow with the number of followers; the number of open
streams is bounded by `max_event_streams` as well (HTTP 429 beyond it).

A follower is sent what arrived since its last send as one chunk, so it costs one socket write per
poll, however many events the poll brought: on the event loop's thread, each write (a system call,
and on loopback the receiver's network processing too) costs far more than the bytes in it, and
that thread competes with the training threads for the CPU and the GIL. The chunk is joined once
and shared by every follower that stands at the same place, which in steady state is all of them.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from .jobs.store import EventRecord, JobStore

log = logging.getLogger("dflash.service")

EVENT_PAGE = 500
FOLLOW_POLL_SECONDS = 0.5  # also how often a follower is written to at most: one chunk per poll
FEED_WINDOW = 4096  # events a feed keeps for its followers; one further behind reads the store
SHARED_CHUNKS = 8  # joined chunks a feed keeps between two polls (one per place followers stand at)


class TooManyStreams(Exception):
    pass


class _Feed:
    def __init__(self, hub: EventHub, job_id: str, start_after: int):
        self.hub = hub
        self.job_id = job_id
        self.base = start_after  # events up to here are not held: a follower behind it reads the store
        self.last = start_after  # the newest event id read
        self.ids: list[int] = []
        self.kinds: list[str] = []
        self.lines: list[bytes] = []  # each held event as its NDJSON line
        self._chunks: dict[int, bytes] = {}  # place -> the held lines after it, joined; until the next poll
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
        if not events:
            return
        for event in events:
            self.ids.append(event.id)
            self.kinds.append(event.kind)
            self.lines.append(self.hub.render(event).encode())
        self.last = events[-1].id
        self._chunks.clear()
        excess = len(self.lines) - FEED_WINDOW
        if excess > 0:
            self.base = self.ids[excess - 1]
            del self.ids[:excess], self.kinds[:excess], self.lines[:excess]

    def chunk_after(self, last: int, wanted: set[str] | None) -> tuple[bytes, int]:
        """The held events after `last` (of the `wanted` kinds; None: all) as one chunk of NDJSON
        lines, and the id up to which it is complete. An unfiltered chunk is joined once per place
        and shared until the next poll brings events."""
        first = bisect.bisect_right(self.ids, last)
        if wanted is not None:
            return b"".join(
                line for line, kind in zip(self.lines[first:], self.kinds[first:]) if kind in wanted
            ), self.last
        chunk = self._chunks.get(last)
        if chunk is None:
            chunk = b"".join(self.lines[first:])
            if len(self._chunks) < SHARED_CHUNKS:
                self._chunks[last] = chunk
        return chunk, self.last

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

    async def follow(self, job_id: str, *, after: int, kinds: list[str] | None) -> AsyncIterator[bytes]:
        """NDJSON lines of the job's events after `after` until the job ends (or the daemon stops),
        in chunks of whole lines: what arrived since the previous chunk."""
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
                    if page:
                        last = page[-1].id
                        yield "".join(map(self.render, page)).encode()
                    if len(page) < EVENT_PAGE:
                        last = max(last, base)  # every matching event up to `base` was in that page
                    continue
                chunk, complete = feed.chunk_after(last, wanted)
                if chunk:
                    yield chunk
                last = max(last, complete)
                if feed.ended and last >= feed.last:
                    return
                await feed.wait_beyond(last)
        finally:
            feed.followers -= 1


class StreamCollector(Collector):
    """Followed event streams: how many are open, and what they cost the store."""

    def __init__(self, hub: EventHub):
        self.hub = hub

    def collect(self):
        yield GaugeMetricFamily(
            "dflash_event_streams",
            "Open followed event streams (GET /jobs/{id}/events?follow=true)",
            value=self.hub.open_streams,
        )
        yield GaugeMetricFamily(
            "dflash_event_streams_max",
            "Followed event streams served at most (max_event_streams)",
            value=self.hub.max_streams,
        )
        yield CounterMetricFamily(
            "dflash_event_stream_store_reads",
            "Store queries made for followed event streams (one poller per followed job, plus catch-ups)",
            value=self.hub.store_reads,
        )
