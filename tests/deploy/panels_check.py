"""Does every panel of the Grafana dashboard show data? Checked against a real Prometheus.

Starts the daemon (tests/service/harness.py: `dflash-trainer serve` as a subprocess on a free loopback
port, temporary data dir) and a Prometheus server scraping it every second, runs a short regeneration, then a short training job with
evaluation, waits for the scrapes, then takes every target expression of
docker/grafana/dashboards/dflash.json, substitutes the template variables the way Grafana does ($instance
and $device resolved from Prometheus, "All" selected; $__rate_interval and $__range fixed) and asks
Prometheus' HTTP API (/api/v1/query) for it. A target passes when it returns at least one series with a
finite value. Targets that read only dflash_cuda_* metrics may be empty when the daemon has no CUDA
device (its dflash_warmup_seconds has no cuda:* device); they are listed as such.

pytest runs it in tests/deploy/test_dashboard_prometheus.py. By hand (e.g. on a GPU machine, against a
CUDA daemon), from the repository root:

    python -m tests.deploy.panels_check [--config DAEMON_CONFIG.toml] [--prometheus /path/to/prometheus]

prints a table panel -> series count and exits 1 if a panel has no data. PROMETHEUS_BIN overrides the
binary (default: `prometheus` on PATH).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.service.harness import Daemon, free_port, write_config

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "docker" / "grafana" / "dashboards" / "dflash.json"
SHIPPED_PROMETHEUS_CONFIG = REPO_ROOT / "docker" / "prometheus" / "prometheus.yml"

# A short job on the embedded default that also evaluates (dflash_eval_acceptance_length gets a value) and
# checkpoints halfway and at the end (dflash_checkpoint_pause_seconds gets more than one observation).
CHECK_JOB: dict[str, Any] = {
    "name": "panels-check",
    "datasets": ["builtin://train"],
    "steps": 20,
    "checkpoint_interval": 10,
    "eval_prompts": "builtin://heldout",
    "eval_interval": 10,
    "eval_max_prompts": 2,
    "eval_max_new_tokens": 16,
}
# A short regeneration before it, for the regeneration panels (dflash_generate_*)
REGENERATE_CHECK_JOB: dict[str, Any] = {
    "name": "panels-check-regenerate",
    "kind": "regenerate",
    "datasets": ["builtin://heldout"],
    "max_new_tokens": 16,
}
# A continual job between them, for the continual panels: it trains on a watched source, publishes,
# loads a new target version in place, and is cancelled (a daemon started here: its data dir is known)
CONTINUAL_CHECK_JOB: dict[str, Any] = {
    "name": "panels-check-continual",
    "kind": "continual",
    "publish_every_steps": 2,
    "checkpoint_interval": 2,
    "heldout_every": 3,
    "eval_max_prompts": 2,
    "eval_max_new_tokens": 8,
    "poll_seconds": 0.1,
}
SCRAPE_INTERVAL = "1s"
# What Grafana's built-in variables become. $__rate_interval is wide enough to hold samples from before
# and after a short job, so rate() and histogram_quantile() see the job's steps.
BUILTINS = {
    "__rate_interval": "30s",
    "__interval": "5s",
    "__interval_ms": "5000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
    "__auto": "5s",
}
CUDA_METRIC_PREFIX = "dflash_cuda_"
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# the daemon's histograms: an expression reads their _bucket/_sum/_count series
HISTOGRAMS = ("dflash_train_step_seconds", "dflash_checkpoint_pause_seconds", "dflash_target_swap_seconds")


def _from_env(var: str) -> str | None:
    path = os.environ.get(var)
    if path and not Path(path).is_file():
        raise FileNotFoundError(f"{var}={path}: no such file")
    return path or None


def find_prometheus() -> str | None:
    """$PROMETHEUS_BIN (which must exist when set), else `prometheus` on PATH, else None."""
    return _from_env("PROMETHEUS_BIN") or shutil.which("prometheus")


def find_promtool() -> str | None:
    """$PROMTOOL_BIN, else `promtool` next to the Prometheus binary, else on PATH, else None."""
    if env := _from_env("PROMTOOL_BIN"):
        return env
    prometheus = find_prometheus()
    if prometheus and (Path(prometheus).parent / "promtool").is_file():
        return str(Path(prometheus).parent / "promtool")
    return shutil.which("promtool")


# --------------------------------------------------------------------------- dashboard
@dataclass
class Target:
    panel: str
    panel_type: str
    ref_id: str
    expr: str

    @property
    def metrics(self) -> set[str]:
        return metric_families(self.expr)

    @property
    def cuda_only(self) -> bool:
        return bool(self.metrics) and all(m.startswith(CUDA_METRIC_PREFIX) for m in self.metrics)


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside (collapsed) rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels") or [])


def dashboard_targets(dashboard: dict[str, Any]) -> list[Target]:
    out = []
    for panel in iter_panels(dashboard.get("panels", [])):
        for target in panel.get("targets") or []:
            if target.get("hide"):
                continue
            out.append(
                Target(
                    panel.get("title", f"panel {panel.get('id')}"),
                    panel.get("type", "?"),
                    target.get("refId", "?"),
                    target["expr"],
                )
            )
    return out


def metric_families(expr: str) -> set[str]:
    """dflash_* metric family names an expression reads (histogram series map to their family)."""
    names = set()
    for name in re.findall(r"\bdflash_[a-z0-9_]+", expr):
        for suffix in _HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
                name = name[: -len(suffix)]
        names.add(name)
    return names


def regex_escape(value: str) -> str:
    """Grafana's escaping of a variable value inside a PromQL regex string (prometheusSpecialRegexEscape)."""
    return re.sub(r"([$^*{}\[\]'+?.()|])", r"\\\\\1", value.replace("\\", "\\\\\\\\"))


def format_multi(values: list[str]) -> str:
    """The value Grafana substitutes for a multi-value variable with "All" selected and no custom allValue."""
    escaped = [regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


_VAR = re.compile(r"\$\{(\w+)(?::[\w]+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace $var, ${var}, ${var:format}, [[var]] and Grafana's $__ built-ins; unknown names raise."""

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in BUILTINS:
            return BUILTINS[name]
        if name in variables:
            return variables[name]
        raise KeyError(f"unknown template variable ${name} in {expr!r}")

    return _VAR.sub(repl, expr)


# --------------------------------------------------------------------------- prometheus
class Prometheus:
    """A Prometheus server on a free loopback port scraping the given targets, with its own temp storage."""

    def __init__(self, binary: str, scrape_targets: list[str], workdir: Path, scrape_interval: str = SCRAPE_INTERVAL):
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / "prometheus.yml"
        self.log_path = workdir / "prometheus.log"
        config = {
            "global": {
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "evaluation_interval": scrape_interval,
            },
            "scrape_configs": [
                {
                    "job_name": "dflash-trainer",
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": scrape_targets}],
                }
            ],
        }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def start(self, timeout: float = 60) -> Prometheus:
        storage = self.workdir / "tsdb"
        storage.mkdir(exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={storage}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1d",
                    "--log.level=warn",
                ],
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; log:\n{self.log()}")
            try:
                if self.http.get("/-/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready at {self.url}; log:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        r = self.http.get("/api/v1/query", params=params)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise QueryError(f"{expr}: HTTP {r.status_code}: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        params: dict[str, Any] = {"start": f"{time.time() - 3600:.3f}", "end": f"{time.time():.3f}"}
        if match:
            params["match[]"] = match
        r = self.http.get(f"/api/v1/label/{label}/values", params=params)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise QueryError(f"label_values({match}, {label}): {body.get('error')}")
        return sorted(body["data"])

    def wait_for(self, expr: str, timeout: float = 60, what: str | None = None) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus never had {what or expr}; log:\n{self.log()}")
            time.sleep(0.25)

    def close(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            self.http.close()


class QueryError(RuntimeError):
    pass


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*?)\s*,\s*)?(\w+)\s*\)\s*$", re.S)


def _variable_query(var: dict[str, Any]) -> str:
    query = var.get("query")
    if isinstance(query, dict):
        query = query.get("query", "")
    return query or var.get("definition", "")


def resolve_variables(dashboard: dict[str, Any], prom: Prometheus) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each template variable's values as Grafana would list them, and the text Grafana puts in a query for
    it with "All" selected. In dashboard order, so a variable's query may use the ones before it. The
    datasource variable is not part of any expression and is skipped."""
    values_of: dict[str, list[str]] = {}
    text_of: dict[str, str] = {}
    for var in dashboard.get("templating", {}).get("list", []):
        name, kind = var["name"], var.get("type")
        if kind == "datasource":
            continue
        if kind == "query":
            m = _LABEL_VALUES.match(_variable_query(var))
            if not m:
                raise ValueError(
                    f"variable {name}: only label_values(...) queries are supported here, got {_variable_query(var)!r}"
                )
            selector, label = m.group(1), m.group(2)
            values = prom.label_values(label, substitute(selector, text_of) if selector else None)
            if var.get("regex"):
                values = [v for v in values if re.search(var["regex"], v)]
        elif kind in ("custom", "interval"):
            values = [o.strip() for o in str(var.get("query", "")).split(",") if o.strip()]
        elif kind in ("constant", "textbox"):
            values = [str(var.get("query", ""))]
        else:
            raise ValueError(f"variable {name}: type {kind!r} is not supported by this check")
        if not values:
            raise AssertionError(f"template variable ${name} has no values in Prometheus ({_variable_query(var)})")
        values_of[name] = values
        if not (var.get("multi") or var.get("includeAll")):
            text_of[name] = values[0].replace("\\", "\\\\").replace("'", "\\'")  # prometheusRegularEscape
        elif var.get("allValue"):
            text_of[name] = var["allValue"]
        else:
            text_of[name] = format_multi(values)
    return values_of, text_of


# --------------------------------------------------------------------------- the check
@dataclass
class Result:
    target: Target
    query: str
    series: int = 0
    finite: int = 0
    error: str | None = None
    allowed_empty: bool = False
    values: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and (self.finite > 0 or self.allowed_empty)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "ERROR"
        if self.finite > 0:
            return "ok"
        if self.allowed_empty:
            return "empty (no CUDA device)"
        return "NO DATA" if self.series == 0 else "NO FINITE VALUE"


@dataclass
class Report:
    results: list[Result]
    variables: dict[str, list[str]]
    devices: list[str]

    @property
    def cuda(self) -> bool:
        return any(d.startswith("cuda") for d in self.devices)

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @property
    def allowed_empty(self) -> list[Result]:
        return [r for r in self.results if r.allowed_empty and r.finite == 0]

    def table(self) -> str:
        width = max(len(f"{r.target.panel} [{r.target.ref_id}]") for r in self.results)
        lines = [
            f"daemon devices: {', '.join(self.devices) or '?'}; variables: "
            + "; ".join(f"${k} = {', '.join(v)}" for k, v in self.variables.items()),
            f"{'PANEL [TARGET]':<{width}}  {'SERIES':>6}  {'FINITE':>6}  STATUS",
        ]
        for r in self.results:
            name = f"{r.target.panel} [{r.target.ref_id}]"
            lines.append(
                f"{name:<{width}}  {r.series:>6}  {r.finite:>6}  {r.status}" + (f": {r.error}" if r.error else "")
            )
        lines.append(
            f"{len(self.results)} targets in {len({r.target.panel for r in self.results})} panels: "
            f"{sum(r.finite > 0 for r in self.results)} with data, {len(self.allowed_empty)} CUDA-only empty "
            f"(allowed without CUDA), {len(self.failures)} failing"
        )
        return "\n".join(lines)


def check_panels_at(dashboard: dict[str, Any], prom: Prometheus, instants: list[float]) -> Report:
    """check_panels at each instant (the last one's variables and devices): a target passes if it
    shows data at one of them."""
    reports = [check_panels(dashboard, prom, at=at) for at in instants]
    results = [next((r for r in rs if r.ok), rs[-1]) for rs in zip(*(rep.results for rep in reports), strict=True)]
    return Report(results, reports[-1].variables, reports[-1].devices)


def check_panels(dashboard: dict[str, Any], prom: Prometheus, at: float | None = None) -> Report:
    variables, subst = resolve_variables(dashboard, prom)
    devices = sorted({s["metric"].get("device", "") for s in prom.query("dflash_warmup_seconds", at)} - {""})
    cuda = any(d.startswith("cuda") for d in devices)
    results = []
    for target in dashboard_targets(dashboard):
        try:
            query = substitute(target.expr, subst)
        except KeyError as e:
            results.append(Result(target, target.expr, error=str(e)))
            continue
        result = Result(target, query, allowed_empty=target.cuda_only and not cuda)
        try:
            series = prom.query(query, at)
        except QueryError as e:
            result.error = str(e)
        else:
            result.series = len(series)
            result.values = [float(s["value"][1]) for s in series]
            result.finite = sum(math.isfinite(v) for v in result.values)
        results.append(result)
    return Report(results, variables, devices)


@dataclass
class Scraped:
    """A daemon that ran a job, and the Prometheus that scraped it."""

    prom: Prometheus
    http: httpx.Client  # the daemon's API
    daemon: Daemon | None  # None when checking a daemon started elsewhere
    job_id: str | None
    at: float  # evaluate queries at this instant: shortly after the job ended and was scraped
    # shortly after each job ended and was scraped: a job's start clears the previous job's series,
    # so the panels of each kind of job are checked at the end of a job of that kind
    instants: list[float] = field(default_factory=list)


@contextmanager
def scraped_daemon(
    *,
    prometheus_bin: str,
    config: Path | None = None,
    data_dir: Path | None = None,
    url: str | None = None,
    job: dict[str, Any] | None = CHECK_JOB,
    before: dict[str, Any] | None = REGENERATE_CHECK_JOB,
    continual_data_dir: Path | None = None,
    ready_timeout: float = 120,
    job_timeout: float = 300,
    workdir: Path | None = None,
    prom: Prometheus | None = None,
    out=sys.stdout,
) -> Iterator[Scraped]:
    """The daemon (started here unless `url` names a running one) with Prometheus scraping it every second,
    after `before` (a job of another kind) and then `job` ran to SUCCEEDED and Prometheus scraped the end
    state; `job_id` is `job`'s (the training panels show the newest job's values). `prom`: a Prometheus
    already started and scraping `url` (the caller stops it), instead of one started here."""
    with ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dflash-panels-")))
        daemon = None
        if url is None:
            daemon = start_daemon(workdir, config=config, data_dir=data_dir)
            stack.callback(daemon.close)
            url, http = daemon.url, daemon.http
            print(f"daemon {url} (log {daemon.log_path})", file=out)
        else:
            http = stack.enter_context(httpx.Client(base_url=url, timeout=30))
        host_port = url.split("://", 1)[-1].rstrip("/")
        if prom is None:
            prom = Prometheus(prometheus_bin, [host_port], workdir)
            stack.callback(prom.close)
            prom.start()
        print(f"prometheus {prom.url} scraping {host_port} every {SCRAPE_INTERVAL} (log {prom.log_path})", file=out)
        _wait_ready(http, ready_timeout, daemon)
        prom.wait_for("dflash_ready == 1", timeout=60, what="a scrape of the ready daemon")
        job_id, instants = None, []
        continual_dir = continual_data_dir or (daemon.data_dir if daemon is not None else None)
        for spec in (before, CONTINUAL_CHECK_JOB if continual_dir is not None else None, job):
            if spec is None:
                continue
            if spec is CONTINUAL_CHECK_JOB:
                assert continual_dir is not None
                _run_continual(http, continual_dir, job_timeout, daemon, out)
            else:
                job_id = _run_job(http, spec, job_timeout, daemon, out)
            # two scrapes after the job ended: the counters' final values and the eval gauge are in
            ended = time.time()
            prom.wait_for(f"timestamp(dflash_ready) > {ended + 1:.3f}", timeout=60, what="scrapes after the job")
            time.sleep(0.5)
            instants.append(time.time())
        yield Scraped(prom, http, daemon, job_id if job is not None else None, at=time.time(), instants=instants)


def start_daemon(
    workdir: Path, *, config: Path | None = None, data_dir: Path | None = None, warmup_pause: float = 0.0
) -> Daemon:
    """The service tests' daemon (tests/service/harness.py). With `config`, the user's file is used as it is
    except for data_dir (a fresh one under workdir unless `data_dir` is given)."""
    data_dir = data_dir or workdir / "data"
    cwd = workdir / "cwd"
    cwd.mkdir(exist_ok=True)
    if config is None:
        config_path = write_config(workdir / "dflash.toml", data_dir)
    else:
        from service.config import _read_file  # the daemon's own reader: relative paths resolved the same way

        settings = _read_file(Path(config).expanduser())
        settings["data_dir"] = str(Path(data_dir).absolute())
        config_path = workdir / "dflash.yaml"
        config_path.write_text(yaml.safe_dump(settings, sort_keys=False))
    daemon = Daemon(config_path, data_dir, cwd, warmup_pause=warmup_pause)
    daemon.log_path = workdir / f"daemon-{daemon.port}.log"
    return daemon.start()


def _wait_ready(http: httpx.Client, timeout: float, daemon: Daemon | None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if daemon is not None:
            daemon._check_alive()
        r = http.get("/healthz")
        if r.status_code == 200:
            return
        if r.json().get("status") == "failed":
            raise RuntimeError(f"daemon failed to start: {r.json()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon not ready after {timeout} s: {r.json()}")
        time.sleep(0.2)


def _run_job(http: httpx.Client, spec: dict[str, Any], timeout: float, daemon: Daemon | None, out) -> str:
    r = http.post("/jobs", json=spec)
    assert r.status_code in (200, 202), f"job submission: HTTP {r.status_code}: {r.text}"
    job_id = r.json()["id"]
    state = _wait_terminal(http, job_id, timeout, daemon)
    print(f"job {job_id} {state}", file=out)
    assert state == "SUCCEEDED", f"job {job_id} ended {state}"
    return job_id


def _run_continual(http: httpx.Client, data_dir: Path, timeout: float, daemon: Daemon | None, out) -> None:
    """CONTINUAL_CHECK_JOB on a watched source until it published, then a new target version until it
    was loaded in place, then cancelled (data_dir: the daemon's, where the source and target live)."""
    source, watch = data_dir / "panels-continual", data_dir / "panels-target"
    source.mkdir(exist_ok=True)
    watch.mkdir(exist_ok=True)
    with (source / "records.jsonl").open("w") as f:
        for i in range(200):  # enough new records for the steps before a publish
            turns = [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}."},
            ]
            f.write(json.dumps({"messages": turns}) + "\n")
    spec = {**CONTINUAL_CHECK_JOB, "sources": [str(source)], "target_watch": str(watch)}
    r = http.post("/jobs", json=spec)
    assert r.status_code == 202, f"continual job submission: HTTP {r.status_code}: {r.text}"
    job_id = r.json()["id"]

    def until(done, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if daemon is not None:
                daemon._check_alive()
            assert time.monotonic() < deadline, f"continual job {job_id}: no {what} after {timeout} s"
            time.sleep(0.1)

    until(lambda: "published" in http.get(f"/jobs/{job_id}").json(), "publish")
    staged = watch / ".v2"
    shutil.copytree(next((data_dir / "defaults").glob("*/target")), staged)
    staged.rename(watch / "v2")
    until(lambda: bool(http.get(f"/jobs/{job_id}/events", params={"kind": "target_swap"}).text.strip()), "target swap")
    http.post(f"/jobs/{job_id}/cancel")
    state = _wait_terminal(http, job_id, timeout, daemon)
    print(f"job {job_id} {state}", file=out)
    assert state == "STOPPED", f"continual job {job_id} ended {state}"


def _wait_terminal(http: httpx.Client, job_id: str, timeout: float, daemon: Daemon | None) -> str:
    deadline = time.monotonic() + timeout
    while True:
        if daemon is not None:
            daemon._check_alive()
        state = http.get(f"/jobs/{job_id}").json()["state"]
        if state in ("SUCCEEDED", "FAILED", "STOPPED"):
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {state} after {timeout} s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deploy.panels_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="daemon config file (default: the embedded default)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="daemon data dir (default: a fresh temporary one; give the usual one to reuse its inductor cache)",
    )
    parser.add_argument("--url", help="check a daemon that is already running at this URL instead of starting one")
    parser.add_argument(
        "--prometheus",
        default=find_prometheus(),
        help="Prometheus binary (default $PROMETHEUS_BIN or `prometheus` on PATH)",
    )
    parser.add_argument(
        "--job", type=Path, help="job spec JSON to run (default: 20 steps of the embedded default with evaluation)"
    )
    parser.add_argument("--no-job", action="store_true", help="submit no job (panels fed by training stay empty)")
    parser.add_argument(
        "--ready-timeout", type=float, default=1800, help="seconds to wait for warmup (default %(default)s)"
    )
    parser.add_argument(
        "--job-timeout", type=float, default=1800, help="seconds to wait for the job (default %(default)s)"
    )
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    args = parser.parse_args(argv)
    if not args.prometheus:
        parser.error(
            "no Prometheus binary: set PROMETHEUS_BIN, pass --prometheus, or install it (apt-get install prometheus)"
        )
    job = None if args.no_job else (json.loads(args.job.read_text()) if args.job else CHECK_JOB)
    with scraped_daemon(
        prometheus_bin=args.prometheus,
        config=args.config,
        data_dir=args.data_dir,
        url=args.url,
        job=job,
        before=None if args.no_job else REGENERATE_CHECK_JOB,
        ready_timeout=args.ready_timeout,
        job_timeout=args.job_timeout,
    ) as scraped:
        report = check_panels_at(load_dashboard(args.dashboard), scraped.prom, scraped.instants or [scraped.at])
    print(report.table())
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
