"""The per-job gauges of service/metrics.py without a running engine: which job's series exist when, and what
they hold (tests/service/test_api.py checks the same through a real daemon's /metrics)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from service.config import ServiceConfig
from service.engine_host import EngineHost
from service.jobs.store import JobStore
from service.metrics import ServiceMetrics
from tests.metric_names import PER_JOB_GAUGES

DRAFT_LENGTH = 3  # accuracy positions 1..3


def _metrics() -> ServiceMetrics:
    """The real collector over a real host that has not started its engine and a real store."""
    directory = Path(tempfile.mkdtemp(prefix="dflash-metrics-"))
    config = ServiceConfig(data_dir=directory)
    return ServiceMetrics(EngineHost(config), JobStore(config.database_path), draft_length=DRAFT_LENGTH)


def _stats(loss: float) -> SimpleNamespace:
    return SimpleNamespace(
        loss=loss,
        position_accuracy=[0.9, 0.6, 0.3],
        expected_acceptance_length=2.5,
        learning_rate=1e-4,
        grad_norm=0.5,
        seconds_per_device={"cpu": 0.1},
    )


def _samples(metrics: ServiceMetrics) -> dict[str, dict[tuple[str, ...], float]]:
    """name -> {(job,) or (job, position): value} for the gauges labelled by job."""
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if "job_id" in s.labels:
                key = tuple(s.labels[k] for k in ("job_id", "position") if k in s.labels)
                out.setdefault(s.name, {})[key] = s.value
    return out


def test_no_job_series_before_the_first_job():
    assert _samples(_metrics()) == {}


def test_a_job_holds_the_series_until_the_next_job_starts():
    metrics = _metrics()
    metrics.start_job("job-a")
    started = _samples(metrics)
    assert set(started) == set(PER_JOB_GAUGES)
    # present from the start, not measured yet; nothing prepared yet
    assert math.isnan(started["dflash_train_loss"][("job-a",)])
    assert sorted(started["dflash_train_accuracy"]) == [("job-a", "1"), ("job-a", "2"), ("job-a", "3")]
    assert started["dflash_data_prepare_progress_ratio"] == {("job-a",): 0.0}

    metrics.observe_data_progress({"fraction": 0.5, "tokens": 1000}, "job-a")
    assert _samples(metrics)["dflash_data_prepare_tokens"] == {("job-a",): 1000.0}
    metrics.observe_data_progress(None, "job-a")
    metrics.observe_step(_stats(3.0), "job-a")
    metrics.observe_eval(2.25, "job-a")
    done = _samples(metrics)  # the job ended: its last values stay
    assert done["dflash_train_loss"] == {("job-a",): 3.0}
    assert done["dflash_train_accuracy"][("job-a", "2")] == 0.6
    assert done["dflash_eval_acceptance_length"] == {("job-a",): 2.25}
    assert done["dflash_data_prepare_progress_ratio"] == {("job-a",): 1.0}

    metrics.start_job("job-b")
    after = _samples(metrics)
    assert {key[0] for series in after.values() for key in series} == {"job-b"}
    assert math.isnan(after["dflash_eval_acceptance_length"][("job-b",)])


def test_a_value_of_an_unannounced_job_starts_it():
    metrics = _metrics()
    metrics.observe_step(_stats(3.0), "job-a")
    metrics.observe_step(_stats(2.0), "job-b")
    samples = _samples(metrics)
    assert samples["dflash_train_loss"] == {("job-b",): 2.0}
    assert {key[0] for series in samples.values() for key in series} == {"job-b"}


def test_a_resumed_job_keeps_its_values_and_prepares_its_data_again():
    metrics = _metrics()
    metrics.start_job("job-a")
    metrics.observe_data_progress(None, "job-a")
    metrics.observe_step(_stats(3.0), "job-a")
    metrics.observe_eval(2.25, "job-a")
    metrics.start_job("job-a")
    samples = _samples(metrics)
    assert samples["dflash_train_loss"] == {("job-a",): 3.0}
    assert samples["dflash_eval_acceptance_length"] == {("job-a",): 2.25}
    assert samples["dflash_data_prepare_progress_ratio"] == {("job-a",): 0.0}


def test_no_series_carries_prometheus_own_job_label():
    """Every per-job series names its job as `job_id`: a `job` label would collide with the one
    Prometheus sets on every scraped series (and be stored renamed)."""
    metrics = _metrics()
    metrics.observe_step(_stats(3.0), "job-a")
    metrics.observe_generate({"new_tokens": 5, "tokens_per_second": 2.0}, "job-a")
    families = list(text_string_to_metric_families(metrics.render().decode()))
    assert not [s.name for f in families for s in f.samples if "job" in s.labels]
    labelled = {s.name for f in families for s in f.samples if s.labels.get("job_id") == "job-a"}
    assert set(PER_JOB_GAUGES) | {"dflash_generate_tokens_total", "dflash_generate_tokens_per_second"} <= labelled
