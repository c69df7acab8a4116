"""Prometheus metrics (docs/design.md, "Metric contract"), on a registry of the daemon's own.

Per-step values (step time histogram, loss, accuracy per block position, acceptance lengths) are
set by the job runner; everything the engine or the store already knows (readiness, warmup times,
compile counts, tokens, queue depths, job counts, CUDA allocator gauges) is read at scrape time by
a custom collector, so a scrape never waits on a training step and never syncs a device.

The gauges that describe one job (loss, accuracy, learning rate, gradient norm, acceptance lengths,
data preparation) carry a `job_id` label, the job's id (not `job`, Prometheus's own target label):
a dashboard or an alert can tell which job a value belongs to, and a series never joins two jobs'
values. They hold the series of one job at a time, from its start until the next job starts, so a
finished job's last values stay scrapeable; before the first job they have no series.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .jobs.store import PENDING, STATES

if TYPE_CHECKING:
    from .engine_host import EngineHost
    from .jobs.store import JobStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Step times from ~10 ms (small GPU shapes) to minutes (large grad_accum on CPU).
STEP_SECONDS_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

# from a launch of asynchronous copies (milliseconds) to waiting for a slow disk (minutes)
CHECKPOINT_PAUSE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# engine.allocator_stats() field -> (metric name, help, counter?)
ALLOCATOR_METRICS = {
    "allocated_bytes": ("dflash_cuda_allocated_bytes", "Bytes held by live tensors (caching allocator)", False),
    "reserved_bytes": ("dflash_cuda_reserved_bytes", "Bytes reserved from the driver by the caching allocator", False),
    "active_bytes": ("dflash_cuda_active_bytes", "Bytes in active allocator blocks", False),
    "inactive_split_bytes": (
        "dflash_cuda_inactive_split_bytes",
        "Bytes in inactive, split blocks (fragmentation)",
        False,
    ),
    "peak_reserved_bytes": ("dflash_cuda_peak_reserved_bytes", "Peak reserved bytes since the process started", False),
    "alloc_retries": ("dflash_cuda_alloc_retries", "cudaMalloc retries after freeing cached blocks", True),
    "ooms": ("dflash_cuda_ooms", "Out-of-memory errors raised by the allocator", True),
}


def _build_info() -> GaugeMetricFamily:
    """dflash_build_info{version,torch,triton,cuda} 1: versions read from the installed packages'
    metadata, so a scrape never imports torch (the daemon answers before torch is loaded); the
    CUDA version once torch is imported."""
    import sys

    torch = sys.modules.get("torch")
    cuda = str(getattr(getattr(torch, "version", None), "cuda", "") or "") if torch is not None else ""
    info = GaugeMetricFamily(
        "dflash_build_info", "Versions of dflash-trainer and its runtime", labels=["version", "torch", "triton", "cuda"]
    )
    info.add_metric([*_package_versions(), cuda], 1)
    return info


@functools.cache
def _package_versions() -> tuple[str, str, str]:
    """(dflash-trainer, torch, triton) versions from package metadata, read once: they do not
    change while the process runs, and reading them costs file system lookups at every scrape."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return ""

    return version("dflash-trainer"), version("torch"), version("triton")


class _EngineCollector(Collector):
    def __init__(self, host: EngineHost, store: JobStore | None):
        """store: None on a multi-host rank other than 0 (it has no job store)."""
        self.host = host
        self.store = store

    def collect(self):
        status = self.host.engine_status()  # None while torch is still being imported
        # the /healthz verdict: in a multi-host group, rank 0 counts every rank, another rank itself
        ready = self.host.status(snapshot=status) == "ready" if status is not None else False
        yield GaugeMetricFamily("dflash_ready", "1 when every drafter is warm and jobs can run", value=int(ready))
        yield GaugeMetricFamily(
            "dflash_drafters_ready", "Drafter replicas warmed", value=status.drafters_ready if status is not None else 0
        )
        # a gauge, so not named *_total (promtool reads that suffix as a counter's)
        yield GaugeMetricFamily(
            "dflash_drafters_expected", "Drafter replicas configured", value=self.host.drafters_total
        )
        yield _build_info()
        if status is None or status.rank == 0:
            yield GaugeMetricFamily(
                "dflash_ranks_ready",
                "Ranks of the multi-host group that are warm and answering (1 process: 1 when warm)",
                value=status.ranks_ready if status is not None else 0,
            )
            yield GaugeMetricFamily(
                "dflash_ranks_expected",
                "Ranks in the multi-host group (1 for one process)",
                value=status.ranks_total if status is not None else (self.host.launch.world if self.host.launch else 1),
            )

        warm = GaugeMetricFamily(
            "dflash_warmup_seconds", "Seconds spent loading/warming each component", labels=["component", "device"]
        )
        totals: dict[tuple[str, str], float] = defaultdict(float)
        for record in status.warmup if status is not None else ():
            totals[(record.component, record.device)] += record.seconds
        for (component, device), seconds in sorted(totals.items()):
            warm.add_metric([component, device], seconds)
        yield warm

        compiles = CounterMetricFamily(
            "dflash_compiles", "Graphs compiled by torch.compile; any at runtime is a bug", labels=["phase"]
        )
        counts = status.compiles if status is not None else {}
        for phase in ("warmup", "runtime"):
            compiles.add_metric([phase], counts.get(phase, 0))
        yield compiles

        tokens = CounterMetricFamily("dflash_train_tokens", "Non-padding context tokens trained", labels=["device"])
        if status is not None:
            per_device = dict.fromkeys(status.drafter_devices, 0)
            per_device.update(status.tokens_per_device)
            for device, n in sorted(per_device.items()):
                tokens.add_metric([device], n)
        yield tokens
        yield GaugeMetricFamily(
            "dflash_train_tokens_per_second",
            "Non-padding context tokens trained per second over the recent steps: the micro-batches' packed "
            "context tokens of every drafter replica (and, on rank 0 of a group, of every rank), not block tokens",
            value=status.tokens_per_second if status is not None else 0.0,
        )

        queues = GaugeMetricFamily(
            "dflash_queue_depth", "Items waiting: queued jobs, micro-batches per drafter queue", labels=["queue"]
        )
        job_counts = self.store.count_by_state() if self.store is not None else None
        if job_counts is not None:
            queues.add_metric(["jobs"], job_counts[PENDING])
        for name, depth in sorted((status.queue_depths if status is not None else {}).items()):
            queues.add_metric([name], depth)
        yield queues

        if job_counts is not None:
            jobs = GaugeMetricFamily("dflash_jobs", "Jobs by state", labels=["state"])
            for state in STATES:
                jobs.add_metric([state], job_counts[state])
            yield jobs

        # CUDA caching-allocator statistics, read now (thread-safe, no device sync); no samples on CPU
        stats = status.allocator if status is not None else {}
        for key, (name, doc, counter) in ALLOCATOR_METRICS.items():
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["device"])
            for device, values in sorted(stats.items()):
                if key in values:
                    family.add_metric([device], values[key])
            yield family


class ServiceMetrics:
    def __init__(self, host: EngineHost, store: JobStore | None, draft_length: int):
        # no `_created` series: they double the series count and no dashboard of ours reads them
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.step_seconds = Histogram(
            "dflash_train_step_seconds",
            "Seconds per training step, per drafter device",
            ["device"],
            buckets=STEP_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.loss = Gauge("dflash_train_loss", "Training loss of the last step", ["job_id"], registry=self.registry)
        self.accuracy = Gauge(
            "dflash_train_accuracy",
            "Top-1 accuracy of the last step per block position",
            ["job_id", "position"],
            registry=self.registry,
        )
        self.learning_rate = Gauge(
            "dflash_train_learning_rate", "Learning rate of the last step", ["job_id"], registry=self.registry
        )
        self.grad_norm = Gauge(
            "dflash_train_grad_norm",
            "Gradient norm of the last step, before clipping",
            ["job_id"],
            registry=self.registry,
        )
        self.expected_acceptance = Gauge(
            "dflash_train_expected_acceptance_length",
            "Acceptance length implied by the last step's per-position accuracy",
            ["job_id"],
            registry=self.registry,
        )
        self.eval_acceptance = Gauge(
            "dflash_eval_acceptance_length",
            "Mean accepted tokens per block in the last held-out evaluation",
            ["job_id"],
            registry=self.registry,
        )
        self.checkpoint_pause = Histogram(
            "dflash_checkpoint_pause_seconds",
            "Training time lost to each checkpoint (the snapshot, and any wait for the previous write)",
            buckets=CHECKPOINT_PAUSE_BUCKETS,
            registry=self.registry,
        )
        self.data_progress = Gauge(
            "dflash_data_prepare_progress_ratio",
            "Share of the job's dataset bytes tokenized or found in the cache (1 once it trains)",
            ["job_id"],
            registry=self.registry,
        )
        self.data_tokens = Gauge(
            "dflash_data_prepare_tokens",
            "Tokens of the job's datasets prepared so far (tokenized or read from the cache)",
            ["job_id"],
            registry=self.registry,
        )
        self.generate_tokens = Counter(
            "dflash_generate_tokens", "Tokens generated by regeneration jobs", ["job_id"], registry=self.registry
        )
        self.generate_rate = Gauge(
            "dflash_generate_tokens_per_second",
            "Tokens per second a regeneration job generates, over its run so far",
            ["job_id"],
            registry=self.registry,
        )
        # a continual job's series, labelled `job_id`: kept across other jobs' runs (a continual job
        # yields to them and resumes), one set per continual job
        self.published_version = Gauge(
            "dflash_published_version", "Newest version a continual job published", ["job_id"], registry=self.registry
        )
        self.published_acceptance = Gauge(
            "dflash_published_acceptance_length",
            "Acceptance length of the published drafter on the latest held-out window of recent records",
            ["job_id"],
            registry=self.registry,
        )
        self.candidate_acceptance = Gauge(
            "dflash_candidate_acceptance_length",
            "Acceptance length of the drafter in training on the latest held-out window of recent records",
            ["job_id"],
            registry=self.registry,
        )
        self.records_ingested = Counter(
            "dflash_records_ingested",
            "Records a continual job read from its sources and ingest route and tokenized",
            ["job_id"],
            registry=self.registry,
        )
        self.records_pending = Gauge(
            "dflash_records_pending",
            "Records a continual job holds that are not trained yet",
            ["job_id"],
            registry=self.registry,
        )
        self.target_swaps = Counter(
            "dflash_target_swaps", "Target versions a continual job loaded in place", ["job_id"], registry=self.registry
        )
        self.target_swap_seconds = Histogram(
            "dflash_target_swap_seconds",
            "Seconds to load a new target version in place",
            ["job_id"],
            buckets=CHECKPOINT_PAUSE_BUCKETS,
            registry=self.registry,
        )
        self._ingested: dict[str, int] = {}  # per job: the run's ingested count last seen
        # the gauges of one job, all labelled `job_id` (never `job`, which is Prometheus's own target
        # label): a new job's start clears them together
        self._job_gauges = (
            self.loss,
            self.accuracy,
            self.learning_rate,
            self.grad_norm,
            self.expected_acceptance,
            self.eval_acceptance,
            self.data_progress,
            self.data_tokens,
            self.generate_rate,
            self.generate_tokens,
        )
        # the drafted tokens of a block, 1-based (a fill-in block's slot k drafts token k)
        self._positions = [str(position) for position in range(1, draft_length + 1)]
        self._job: str | None = None  # whose series the per-job gauges hold
        host.on_engine_created(self._engine_created)
        self.registry.register(_EngineCollector(host, store))
        # host memory matters (a checkpoint needs 12 bytes per drafter parameter of it), and the
        # process's CPU time and open files: the standard process_* series
        ProcessCollector(registry=self.registry)

    def _engine_created(self, engine) -> None:
        for device in engine.status().drafter_devices:  # a series per device from the first scrape on
            self.step_seconds.labels(device=device)

    def start_job(self, job: str) -> None:
        """A run of `job` begins. Another job's series end here (not when that job ended, so its last
        values stay scrapeable until then); the new job's per-step series appear at once, NaN until
        measured, so a dashboard lists the job while it prepares its data. A run of the job that
        already holds the series (a resume) keeps its last values until new ones replace them."""
        if job != self._job:
            for gauge in self._job_gauges:
                gauge.clear()
            self._job = job
            for gauge in (self.loss, self.learning_rate, self.grad_norm, self.expected_acceptance):
                gauge.labels(job_id=job).set(math.nan)
            for position in self._positions:
                self.accuracy.labels(job_id=job, position=position).set(math.nan)
            self.eval_acceptance.labels(job_id=job).set(math.nan)
        # every run prepares (or finds in the cache) its data before it trains
        self.data_progress.labels(job_id=job).set(0.0)
        self.data_tokens.labels(job_id=job).set(0.0)

    def _for_job(self, job: str) -> None:
        if job != self._job:  # a value of a job whose start was not announced starts it
            self.start_job(job)

    def observe_step(self, stats, job: str) -> None:
        self._for_job(job)
        for device, seconds in stats.seconds_per_device.items():
            self.step_seconds.labels(device=device).observe(seconds)
        self.loss.labels(job_id=job).set(stats.loss)
        self.learning_rate.labels(job_id=job).set(stats.learning_rate)
        self.grad_norm.labels(job_id=job).set(stats.grad_norm)
        for position, accuracy in enumerate(stats.position_accuracy, start=1):
            self.accuracy.labels(job_id=job, position=str(position)).set(accuracy)
        self.expected_acceptance.labels(job_id=job).set(stats.expected_acceptance_length)

    def observe_device_steps(self, stats) -> None:
        """A step's seconds per drafter device only: a multi-host rank other than 0 (rank 0 exports
        the job's series; the other ranks, their own devices')."""
        for device, seconds in stats.seconds_per_device.items():
            self.step_seconds.labels(device=device).observe(seconds)

    def observe_eval(self, acceptance_length: float, job: str) -> None:
        self._for_job(job)
        self.eval_acceptance.labels(job_id=job).set(acceptance_length)

    def observe_checkpoint_pause(self, seconds: float) -> None:
        self.checkpoint_pause.observe(seconds)

    def observe_data_progress(self, progress: dict | None, job: str) -> None:
        """A job's data preparation progress; None once it trains."""
        self._for_job(job)
        if progress is None:
            self.data_progress.labels(job_id=job).set(1.0)
            return
        self.data_progress.labels(job_id=job).set(float(progress.get("fraction", 0.0)))
        self.data_tokens.labels(job_id=job).set(float(progress.get("tokens", 0)))

    def observe_generate(self, progress: dict, job: str) -> None:
        """A regeneration's progress (new tokens since its last report, its rate)."""
        self._for_job(job)
        self.generate_tokens.labels(job_id=job).inc(max(0, int(progress.get("new_tokens", 0))))
        rate = progress.get("tokens_per_second")  # not measured yet: NaN, never a made-up 0
        self.generate_rate.labels(job_id=job).set(math.nan if rate is None else float(rate))

    def observe_records(self, ingested: int, pending: int, job_id: str) -> None:
        """A continual job's records: the run's count of ingested records (a new run counts from 0)."""
        last = self._ingested.get(job_id, 0)
        self.records_ingested.labels(job_id=job_id).inc(max(0, ingested - last) if ingested >= last else ingested)
        self._ingested[job_id] = ingested
        self.records_pending.labels(job_id=job_id).set(pending)

    def observe_target_swap(self, seconds: float, job_id: str) -> None:
        self.target_swaps.labels(job_id=job_id).inc()
        self.target_swap_seconds.labels(job_id=job_id).observe(seconds)

    def observe_publish(self, result: dict, job_id: str) -> None:
        if result.get("candidate_tau") is not None:
            self.candidate_acceptance.labels(job_id=job_id).set(float(result["candidate_tau"]))
        if result.get("published"):
            self.published_version.labels(job_id=job_id).set(int(result["version"]))
            self.published_acceptance.labels(job_id=job_id).set(float(result["tau"]))
        elif result.get("published_tau") is not None:
            self.published_acceptance.labels(job_id=job_id).set(float(result["published_tau"]))

    def render(self) -> bytes:
        return generate_latest(self.registry)
