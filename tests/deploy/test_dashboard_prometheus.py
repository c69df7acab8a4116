"""The Grafana dashboard against a real Prometheus: a real daemon (CPU, embedded default) runs a job while
a Prometheus server scrapes it every second; every panel target of docker/grafana/dashboards/dflash.json,
with its template variables substituted, must return data from /api/v1/query. CUDA-only panels may be
empty only on a daemon without a CUDA device; they are printed. The same check runs by hand on a GPU
machine: `python -m tests.deploy.panels_check --config DAEMON_CONFIG.toml` (see panels_check.py).

Needs a `prometheus` binary (Debian package `prometheus`, which .ci/run installs, or $PROMETHEUS_BIN);
without one the Prometheus tests skip and say so."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.panels_check import (
    CHECK_JOB,
    Prometheus,
    Target,
    check_panels,
    check_panels_at,
    dashboard_targets,
    find_prometheus,
    find_promtool,
    load_dashboard,
    scraped_daemon,
    start_daemon,
)
from tests.deploy.test_deploy_files import healthcheck

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The daemon and, where there is a prometheus binary, a Prometheus scraping it, started with it:
    Prometheus scrapes first about 5 s after its start (its target discovery sends updates that often),
    which passes while the daemon warms up."""
    # a warmup pause per phase keeps the daemon warming for a few seconds, for the healthcheck test
    d = start_daemon(tmp_path_factory.mktemp("panels"), warmup_pause=1.0)
    binary, prom = find_prometheus(), None
    try:
        if binary is not None:
            prom = Prometheus(binary, [f"127.0.0.1:{d.port}"], tmp_path_factory.mktemp("prometheus")).start()
        yield d, binary, prom
    finally:
        if prom is not None:
            prom.close()
        d.close()


@pytest.fixture(scope="module")
def daemon(served):
    return served[0]


@pytest.fixture(scope="module")
def scraped(served):
    daemon, binary, prom = served
    if binary is None or prom is None:
        pytest.skip(
            "no prometheus binary: install the Debian package `prometheus` (.ci/run does) or set PROMETHEUS_BIN"
        )
    log = io.StringIO()
    with scraped_daemon(
        prometheus_bin=binary,
        url=daemon.url,
        job=CHECK_JOB,
        continual_data_dir=daemon.data_dir,
        workdir=prom.workdir,
        prom=prom,
        out=log,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def report(scraped):
    return check_panels_at(load_dashboard(), scraped.prom, scraped.instants)


def test_docker_healthcheck_command_fails_while_warming_and_passes_when_ready(daemon):
    """The Dockerfile's HEALTHCHECK command itself, run against the daemon."""
    _, command = healthcheck()
    if command[0] == "python":
        command = [sys.executable, *command[1:]]
    env = {**os.environ, "DFLASH_PORT": str(daemon.port)}
    assert daemon.http.get("/healthz").status_code == 503  # just started: warming
    warming = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    if daemon.http.get("/healthz").status_code == 503:  # (not ready in between)
        assert warming.returncode != 0 and "503" in warming.stderr
    daemon.wait_ready()
    ready = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert ready.returncode == 0, ready.stderr
    assert daemon.http.get("/livez").status_code == 200


def test_every_panel_target_returns_data(report, capsys):
    assert not report.failures, "panels without data:\n" + report.table()
    with capsys.disabled():
        if report.allowed_empty:
            names = sorted({r.target.panel for r in report.allowed_empty})
            print(
                f"\n[dashboard] daemon devices {', '.join(report.devices)}: no CUDA device, so these CUDA-only "
                f"panels are empty: {'; '.join(names)}"
            )
    print(report.table())  # in the captured output (shown with -rA or on failure)
    with_data = {r.target.panel for r in report.results if r.finite}
    assert len(with_data) >= 15
    if report.cuda:
        assert not report.allowed_empty


def test_no_panel_is_excused_except_cuda_memory(report):
    for r in report.allowed_empty:
        assert r.target.metrics and all(m.startswith("dflash_cuda_") for m in r.target.metrics), r.target


def test_every_dashboard_metric_is_exported_by_the_daemon(daemon):
    exported = {f.name for f in text_string_to_metric_families(daemon.http.get("/metrics").text)}
    # the parser drops counters' _total suffix
    exported |= {f"{name}_total" for name in exported}
    for target in dashboard_targets(load_dashboard()):
        assert target.metrics <= exported, f"{target.panel}: {target.metrics - exported} not in /metrics"


def test_the_check_reports_missing_and_nan_data(scraped):
    """The check has teeth: an unknown metric, a NaN-only result and a broken expression all fail; an unknown
    CUDA metric is excused only because this daemon has no CUDA device."""
    dashboard = copy.deepcopy(load_dashboard())
    panel = copy.deepcopy(next(p for p in dashboard["panels"] if p.get("targets")))
    panel["id"], panel["title"] = 9999, "doctored"
    panel["targets"] = [
        {"refId": "A", "expr": 'dflash_no_such_metric{instance=~"$instance"}'},
        {"refId": "B", "expr": '(dflash_ready{instance=~"$instance"} - dflash_ready) / 0 * 0'},
        {"refId": "C", "expr": 'sum(dflash_ready{instance=~"$instance"}'},
        {"refId": "D", "expr": 'dflash_cuda_no_such_bytes{instance=~"$instance", device=~"$device"}'},
    ]
    dashboard["panels"] = [panel]
    report = check_panels(dashboard, scraped.prom, at=scraped.at)
    status = {r.target.ref_id: r.status for r in report.results}
    assert status["A"] == "NO DATA"
    assert status["B"] == "NO FINITE VALUE"
    assert status["C"] == "ERROR"
    if report.cuda:
        assert status["D"] == "NO DATA"
    else:
        assert status["D"] == "empty (no CUDA device)"
    assert {r.target.ref_id for r in report.failures} == ({"A", "B", "C", "D"} if report.cuda else {"A", "B", "C"})


def test_the_job_id_label_is_stored_as_it_is_exported(scraped):
    """The daemon labels its per-job gauges `job_id` (the job id), which Prometheus stores as it is, beside
    its own `job` (the scrape job's name); the dashboard's legends read job_id."""
    for name in ("dflash_train_loss", "dflash_train_accuracy", "dflash_eval_acceptance_length"):
        series = scraped.prom.query(name, scraped.at)
        assert {s["metric"].get("job_id") for s in series} == {scraped.job_id}, name
        assert all("exported_job" not in s["metric"] for s in series), name
        assert {s["metric"]["job"] for s in series} == {"dflash-trainer"}, name


def test_variables_resolve_to_the_scraped_daemon(report, daemon):
    assert report.variables["instance"] == [f"127.0.0.1:{daemon.port}"]
    assert report.variables["device"] == report.devices


def test_promtool_accepts_the_test_prometheus_config(scraped):
    promtool = find_promtool()
    if promtool is None:
        pytest.skip("no promtool next to the prometheus binary or on PATH")
    r = subprocess.run(
        [promtool, "check", "config", str(scraped.prom.config_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_target_classification():
    assert Target("p", "stat", "A", 'dflash_cuda_ooms_total{device=~"$device"}').cuda_only
    assert not Target("p", "stat", "A", "dflash_cuda_reserved_bytes / dflash_ready").cuda_only
    assert json.dumps(load_dashboard())  # loads
