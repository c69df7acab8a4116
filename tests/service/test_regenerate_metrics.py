"""The regeneration series of service/metrics.py: tokens counted per job from the progress
reports, the rate as reported, both gone when the next job starts."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.service.test_metrics import _metrics


def _series(metrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name.startswith("dflash_generate_"):
                out[(s.name, s.labels["job_id"])] = s.value
    return out


def test_generate_series_per_job():
    metrics = _metrics()
    assert _series(metrics) == {}
    metrics.start_job("job-r")
    metrics.observe_generate({"new_tokens": 120, "tokens_per_second": 60.0}, "job-r")
    metrics.observe_generate({"new_tokens": 80, "tokens_per_second": 50.0}, "job-r")
    assert _series(metrics) == {
        ("dflash_generate_tokens_total", "job-r"): 200.0,
        ("dflash_generate_tokens_per_second", "job-r"): 50.0,
    }
    metrics.start_job("job-t")
    assert _series(metrics) == {}


def test_an_unmeasured_generation_rate_is_nan_not_zero():
    import math

    metrics = _metrics()
    metrics.observe_generate({"new_tokens": 0, "tokens_per_second": None}, "job-r")
    assert math.isnan(_series(metrics)[("dflash_generate_tokens_per_second", "job-r")])
