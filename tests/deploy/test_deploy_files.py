"""The deployment files under docker/ hang together: compose and k8s YAML parse and reference files that
exist, ports and paths agree across Dockerfile, compose, Prometheus, Grafana and k8s, the probes hit the
daemon's real endpoints, and the dashboard reads exactly the metric contract (docs/design.md).
No Docker or cluster needed; the Prometheus-backed check is test_dashboard_prometheus.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.panels_check import (
    DASHBOARD,
    SHIPPED_PROMETHEUS_CONFIG,
    dashboard_targets,
    find_promtool,
    iter_panels,
    metric_families,
)
from tests.metric_names import CONTRACT_METRICS, PER_JOB_GAUGES, PER_JOB_GENERATE

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER = REPO_ROOT / "docker"
K8S = DOCKER / "k8s"

PER_JOB_METRICS = CONTRACT_METRICS & {*PER_JOB_GAUGES, *PER_JOB_GENERATE}


# --------------------------------------------------------------------------- Dockerfile
def dockerfile_instructions(path: Path = DOCKER / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def instruction(name: str) -> list[str]:
    return [args for word, args in dockerfile_instructions() if word == name]


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def dockerfile_env() -> dict[str, str]:
    env = {}
    for args in instruction("ENV"):
        for token in shlex.split(args):
            key, _, value = token.partition("=")
            env[key] = value
    return env


def healthcheck() -> tuple[dict[str, str], list[str]]:
    (args,) = instruction("HEALTHCHECK")
    options, _, command = args.partition("CMD")
    flags = dict(re.findall(r"--([\w-]+)=(\S+)", options))
    return flags, exec_form(command.strip())


def url_paths(text: str) -> list[str]:
    return re.findall(r"https?://[^/\s'\"]+(/[\w/.-]*)", text)


def seconds(duration: str) -> float:
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration):
        total += float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def test_dockerfile_base_user_entrypoint_volume_port():
    (base_arg,) = [a for a in instruction("ARG") if a.startswith("BASE_IMAGE=")]
    assert "pytorch/pytorch" in base_arg and "cuda" in base_arg
    assert instruction("FROM") == ["${BASE_IMAGE}"]
    (user,) = instruction("USER")
    assert user not in ("root", "0")
    assert exec_form(instruction("ENTRYPOINT")[0]) == ["dflash-trainer", "serve"]
    env = dockerfile_env()
    data_dir = env["DFLASH_DATA_DIR"]
    volumes = [v for args in instruction("VOLUME") for v in exec_form(args)]
    assert data_dir in volumes  # the job store, checkpoints and <data_dir>/inductor-cache persist
    assert instruction("EXPOSE") == [env["DFLASH_PORT"]]
    assert env["DFLASH_HOST"] == "0.0.0.0"  # reachable from outside the container


def test_dockerfile_installs_dependencies_before_copying_the_sources():
    """A source edit must not re-run the dependency install (minutes, gigabytes): the layer that
    installs pyproject.toml's dependencies comes before any source COPY, and sees only that file and
    the image's pins."""
    steps = [(w, a) for w, a in dockerfile_instructions() if w in ("COPY", "RUN")]
    first_source = next(i for i, (w, a) in enumerate(steps) if w == "COPY" and "pyproject.toml" not in a)
    deps = next(i for i, (w, a) in enumerate(steps) if w == "RUN" and "-r /tmp/requirements.txt" in a)
    assert deps < first_source
    assert [a for w, a in steps[:deps] if w == "COPY"] == ["pyproject.toml docker/constraints.txt ./"]
    script = steps[deps][1]
    extract = re.search(r'python -c "(import tomllib.*?)"\s*>', script).group(1)  # as the shell passes it
    out = subprocess.run(
        [sys.executable, "-c", extract], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_dockerfile_copies_only_existing_paths_that_the_dockerignore_keeps():
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text()
    for args in instruction("COPY"):
        *sources, _dest = shlex.split(args)
        for src in sources:
            assert (REPO_ROOT / src).exists(), src
            assert f"!{src.rstrip('/')}" in ignore, f"{src} is excluded from the build context"


def test_dockerfile_healthcheck_hits_the_probe_path_on_the_daemon_port():
    flags, command = healthcheck()
    paths = url_paths(" ".join(command))
    assert paths == ["/healthz"]
    assert "DFLASH_PORT" in " ".join(command)
    probes = k8s_container()
    assert probes["startupProbe"]["httpGet"]["path"] == paths[0]
    assert probes["readinessProbe"]["httpGet"]["path"] == paths[0]
    assert probes["livenessProbe"]["httpGet"]["path"] == "/livez"
    # the start period covers a cold warmup, as long as the k8s startup probe allows
    start_period = seconds(flags["start-period"])
    assert start_period >= 600
    startup = probes["startupProbe"]
    k8s_window = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert k8s_window >= start_period


def test_the_probed_endpoints_exist_in_the_app(tmp_path):
    from service.app import create_app
    from service.http_guard import UNGUARDED_READS

    app = create_app(load_daemon_config(None, tmp_path))  # the routes only: nothing starts before serving
    served = {(method.upper(), path) for path, operations in app.openapi()["paths"].items() for method in operations}
    for path in ("/healthz", "/livez", "/metrics"):
        assert ("GET", path) in served
        assert path in UNGUARDED_READS  # probes and scrapes need no token, even with protect_reads


# --------------------------------------------------------------------------- compose
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def bind_mounts(service: dict) -> dict[str, str]:
    """container path -> host source, for bind mounts (short syntax with a path source)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                out[volume["target"]] = volume["source"]
            continue
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/", "~")):
            out[target] = source
    return out


def test_compose_parses_and_its_files_exist():
    services = compose()["services"]
    assert set(services) >= {"dflash", "prometheus", "grafana"}
    build = services["dflash"]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == REPO_ROOT
    assert (context / build["dockerfile"]).is_file()
    for name, service in services.items():
        for target, source in bind_mounts(service).items():
            assert (DOCKER / source).exists(), f"{name}: {source} (mounted at {target}) does not exist"
    named = {
        v.split(":")[0]
        for s in services.values()
        for v in s.get("volumes", [])
        if isinstance(v, str) and not v.startswith((".", "/", "~"))
    }
    assert named <= set(compose().get("volumes") or {}), "named volumes must be declared"


def test_compose_daemon_gpu_volume_config():
    service = compose()["services"]["dflash"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in device["capabilities"] and device["driver"] == "nvidia"
    data_dir = dockerfile_env()["DFLASH_DATA_DIR"]
    assert any(v.split(":")[1] == data_dir for v in service["volumes"] if not v.startswith((".", "/")))
    # the config file passed to `serve` is the one mounted, and the daemon accepts it
    args = service["command"]
    config_in_container = args[args.index("--config") + 1]
    config = DOCKER / bind_mounts(service)[config_in_container]
    load_daemon_config(config)
    assert seconds(service["stop_grace_period"]) > 120  # the daemon's default shutdown_timeout_seconds


def load_daemon_config(path: Path | None, home: Path | str = "/nonexistent", **env: str):
    from service.config import load_config

    return load_config(path, env={"HOME": str(home), **env})


def test_compose_requires_the_token_and_answers_its_service_name():
    services = compose()["services"]
    daemon = services["dflash"]
    token = daemon["environment"]["DFLASH_AUTH_TOKEN"]
    # ${VAR:?message}: compose refuses to start without it (${VAR:-} would start an unauthenticated daemon)
    assert re.fullmatch(r"\$\{DFLASH_AUTH_TOKEN:\?[^}]+\}", token), token
    args = daemon["command"]
    config_path = DOCKER / bind_mounts(daemon)[args[args.index("--config") + 1]]
    env = {"DFLASH_HOST": dockerfile_env()["DFLASH_HOST"]}
    config = load_daemon_config(config_path, **env)
    assert config.exposure_problem() is not None  # what the token requirement prevents
    config = load_daemon_config(config_path, **env, DFLASH_AUTH_TOKEN="t")
    assert config.exposure_problem() is None
    # the names the daemon is reached by: Prometheus scrapes it by its service name
    from service.http_guard import Policy

    (target,) = [
        t
        for sc in yaml.safe_load(SHIPPED_PROMETHEUS_CONFIG.read_text())["scrape_configs"]
        for c in sc["static_configs"]
        for t in c["targets"]
    ]
    assert target.split(":")[0] in services
    policy = Policy(config)
    assert policy.host_allowed(target) and policy.host_allowed(f"127.0.0.1:{instruction('EXPOSE')[0]}")
    assert not policy.host_allowed("attacker.example") and "*" not in config.allowed_hosts


def test_compose_prometheus_scrapes_the_daemon_every_5s():
    services = compose()["services"]
    prometheus = services["prometheus"]
    mounts = bind_mounts(prometheus)
    config_arg = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_path = DOCKER / mounts[config_arg.split("=", 1)[1]]
    assert config_path.resolve() == SHIPPED_PROMETHEUS_CONFIG.resolve()
    config = yaml.safe_load(config_path.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "dflash-trainer"]
    assert job["scrape_interval"] == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (target,) = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert target == f"dflash:{instruction('EXPOSE')[0]}"
    # Prometheus starts with the daemon (it must scrape the warmup); Grafana waits for a healthy Prometheus
    assert "dflash" in prometheus["depends_on"]
    assert prometheus["healthcheck"]["test"]
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_compose_grafana_provisioning_shows_the_dashboard():
    grafana = compose()["services"]["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = {t: DOCKER / s for t, s in mounts.items() if t.startswith("/etc/grafana/provisioning")}
    datasources = provisioning["/etc/grafana/provisioning/datasources"]
    providers = provisioning["/etc/grafana/provisioning/dashboards"]

    (ds_file,) = datasources.glob("*.yaml")
    (ds,) = yaml.safe_load(ds_file.read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    assert ds["url"] == "http://prometheus:9090"
    assert seconds(ds["jsonData"]["timeInterval"]) == 5

    (provider_file,) = providers.glob("*.yaml")
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    dashboards_in_container = provider["options"]["path"]
    dashboards_on_host = DOCKER / mounts[dashboards_in_container]
    assert (dashboards_on_host / DASHBOARD.name).resolve() == DASHBOARD.resolve()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path(dashboards_in_container) and (dashboards_on_host / Path(home).name).is_file()


# --------------------------------------------------------------------------- k8s
def k8s_documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def k8s_kind(kind: str) -> list[dict]:
    return [d for d in k8s_documents() if d["kind"] == kind]


def k8s_container() -> dict:
    (deployment,) = k8s_kind("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_k8s_manifests_parse_and_kustomization_lists_them():
    (kustomization,) = k8s_kind("Kustomization")
    listed = set(kustomization["resources"])
    for resource in listed:
        assert (K8S / resource).is_file(), resource
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == manifests
    kinds = {d["kind"] for d in k8s_documents()}
    assert kinds >= {"Deployment", "Service", "PersistentVolumeClaim", "ConfigMap"}
    for doc in k8s_documents():
        assert doc.get("apiVersion") and (doc["kind"] == "Kustomization" or doc["metadata"]["name"])


def test_k8s_deployment_wiring():
    (deployment,) = k8s_kind("Deployment")
    pod = deployment["spec"]["template"]
    container = k8s_container()
    (port,) = container["ports"]
    assert port["containerPort"] == int(instruction("EXPOSE")[0])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in (port["name"], port["containerPort"])
    # GPUs, non-root, time to checkpoint on SIGTERM
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["terminationGracePeriodSeconds"] > 120
    # Prometheus scrape annotations point at the container port and /metrics
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    assert annotations["prometheus.io/path"] == "/metrics"
    # selectors match the pod
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (service,) = k8s_kind("Service")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] in (port["name"], port["containerPort"])


def _k8s_env() -> dict[str, dict]:
    return {e["name"]: e for e in k8s_container()["env"]}


def test_k8s_requires_the_token_secret():
    env = _k8s_env()
    ref = env["DFLASH_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    assert ref.get("optional", False) is False  # no Secret, no pod: never an unauthenticated daemon


def test_k8s_allowed_hosts_name_the_service_and_the_pod(tmp_path):
    from service.http_guard import Policy

    env = _k8s_env()
    names = [e["name"] for e in k8s_container()["env"]]
    value = env["DFLASH_ALLOWED_HOSTS"]["value"]
    # $(VAR) expands only variables defined earlier in the list
    for var in re.findall(r"\$\((\w+)\)", value):
        assert names.index(var) < names.index("DFLASH_ALLOWED_HOSTS"), var
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    expanded = value.replace("$(POD_NAMESPACE)", "ml").replace("$(POD_IP)", "10.1.2.3")
    config = load_daemon_config(
        None, tmp_path, DFLASH_HOST="0.0.0.0", DFLASH_AUTH_TOKEN="t", DFLASH_ALLOWED_HOSTS=expanded
    )
    policy = Policy(config)
    (service,) = k8s_kind("Service")
    port = service["spec"]["ports"][0]["port"]
    name = service["metadata"]["name"]
    for host in (name, f"{name}.ml", f"{name}.ml.svc", f"{name}.ml.svc.cluster.local", "10.1.2.3"):
        assert policy.host_allowed(f"{host}:{port}"), host  # the Service's names; probes and scrapes by pod IP
    assert not policy.host_allowed("attacker.example")


def test_k8s_volumes_pvc_and_config(tmp_path):
    pod = k8s_kind("Deployment")[0]["spec"]["template"]["spec"]
    container = k8s_container()
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    data = volumes[mounts[dockerfile_env()["DFLASH_DATA_DIR"]]]
    assert data["persistentVolumeClaim"]["claimName"] in {
        p["metadata"]["name"] for p in k8s_kind("PersistentVolumeClaim")
    }
    args = container["args"]
    config_file = Path(args[args.index("--config") + 1])
    config_volume = volumes[mounts[str(config_file.parent)]]
    (configmap,) = [c for c in k8s_kind("ConfigMap") if c["metadata"]["name"] == config_volume["configMap"]["name"]]
    text = configmap["data"][config_file.name]
    (tmp_path / config_file.name).write_text(text)
    load_daemon_config(tmp_path / config_file.name)  # the daemon accepts the ConfigMap's file


# --------------------------------------------------------------------------- dashboard (static)
def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = list(iter_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance", "device"} <= set(variables)
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("description"), f"{panel['title']}: the README and the panel's (i) explain each panel"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert 'instance=~"$instance"' in target["expr"], f"{panel['title']}: not filtered by $instance"
    # every panel reading per-device metrics follows the device variable (a total over all devices need not)
    for target in dashboard_targets(dashboard):
        if "(total)" in target.panel:
            continue
        if (
            target.metrics & {"dflash_train_tokens_total", "dflash_train_step_seconds", "dflash_warmup_seconds"}
            or target.cuda_only
        ):
            assert 'device=~"$device"' in target.expr, f"{target.panel}: not filtered by $device"


def test_dashboard_reads_exactly_the_metric_contract():
    used = set().union(*(t.metrics for t in dashboard_targets(json.loads(DASHBOARD.read_text()))))
    assert used - CONTRACT_METRICS == set(), "metrics outside the metric contract (docs/design.md)"
    assert CONTRACT_METRICS - used == set(), "contract metrics without a panel"


def test_runtime_compiles_alert_threshold():
    """Runtime compiles should be flat zero; any value >= 1 turns the panels red."""
    dashboard = json.loads(DASHBOARD.read_text())
    compile_panels = [
        p for p in iter_panels(dashboard["panels"]) if any('phase="runtime"' in t["expr"] for t in p.get("targets", []))
    ]
    assert len(compile_panels) >= 2  # the stat and the time series
    for panel in compile_panels:
        steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert steps[0]["color"] == "green" and {"color": "red", "value": 1} in steps, panel["title"]
    (series,) = [p for p in compile_panels if p["type"] == "timeseries"]
    assert series["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] in ("line+area", "area")


def test_time_series_of_per_job_gauges_name_the_job():
    """Two jobs' series of a per-job gauge in one time range are told apart by the job in the legend."""
    dashboard = json.loads(DASHBOARD.read_text())
    checked = 0
    for panel in iter_panels(dashboard["panels"]):
        if panel["type"] != "timeseries":
            continue
        for target in panel["targets"]:
            if metric_families(target["expr"]) & PER_JOB_METRICS:
                assert "{{job_id}}" in target["legendFormat"], f"{panel['title']} [{target['refId']}]"
                checked += 1
    assert checked >= 6  # loss, accuracy, both acceptance lengths, learning rate, gradient norm


def test_metric_families_maps_histogram_series():
    assert metric_families('rate(dflash_train_step_seconds_bucket{a="b"}[1m]) / dflash_train_tokens_total') == {
        "dflash_train_step_seconds",
        "dflash_train_tokens_total",
    }
    assert metric_families("increase(dflash_checkpoint_pause_seconds_count[1h])") == {"dflash_checkpoint_pause_seconds"}


# --------------------------------------------------------------------------- promtool
def test_promtool_accepts_the_shipped_prometheus_config():
    promtool = find_promtool()
    if promtool is None:
        pytest.skip("no promtool (Debian package `prometheus`, which .ci/run installs; or set PROMTOOL_BIN)")
    r = subprocess.run(
        [promtool, "check", "config", str(SHIPPED_PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_image_pins_what_ci_tests():
    """docker/constraints.txt pins every runtime dependency (but torch, triton and numpy, which the
    CUDA base image brings) at the version requirements-cpu.txt installs for the tests."""

    def pins(path: Path) -> dict[str, str]:
        out = {}
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if "==" in line:
                name, version = line.split("==")
                out[name.strip().lower()] = version.strip()
        return out

    image, tested = pins(DOCKER / "constraints.txt"), pins(REPO_ROOT / "requirements-cpu.txt")
    runtime = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0].lower() for d in runtime} - {"torch", "triton", "numpy"}
    assert names <= set(image), sorted(names - set(image))
    assert all(image[n] == tested[n] for n in image), {n: (image[n], tested.get(n)) for n in image}
    assert any("constraints.txt" in args for args in instruction("RUN")) or any(
        "constraints.txt" in a for a in instruction("COPY")
    )
