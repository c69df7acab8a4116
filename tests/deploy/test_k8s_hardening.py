"""Kubernetes deployment hardening: the pod meets Pod Security "restricted" with a read-only root
filesystem and writable volumes where the daemon writes; the monitoring manifests select the pod,
and their alert rules are valid Prometheus rules over metrics the daemon exports."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.deploy.panels_check import find_promtool, metric_families
from tests.deploy.test_deploy_files import CONTRACT_METRICS, K8S, k8s_container, k8s_kind

MONITORING = K8S / "monitoring"


def test_pod_meets_the_restricted_pod_security_standard():
    pod = k8s_kind("Deployment")[0]["spec"]["template"]["spec"]
    psc, csc = pod["securityContext"], k8s_container()["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
    assert csc["readOnlyRootFilesystem"] is True
    assert not csc.get("privileged") and "add" not in csc["capabilities"]
    # with the root filesystem read-only, every place the daemon and its compilers write is a volume
    mounts = {m["mountPath"] for m in k8s_container()["volumeMounts"]}
    assert {"/var/lib/dflash-trainer", "/tmp", "/home/dflash/.cache"} <= mounts


def monitoring(kind: str) -> dict:
    docs = [d for f in sorted(MONITORING.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return next(d for d in docs if d.get("kind") == kind)


def test_podmonitor_selects_the_daemon_and_its_port():
    pm = monitoring("PodMonitor")
    labels = k8s_kind("Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in k8s_container()["ports"]}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= ports
    listed = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in MONITORING.glob("*.yaml") if p.name != "kustomization.yaml")


def test_alert_rules_are_valid_and_use_exported_metrics(tmp_path):
    groups = monitoring("PrometheusRule")["spec"]["groups"]
    alerts = {r["alert"]: r["expr"] for g in groups for r in g["rules"]}
    assert {"DflashRuntimeCompile", "DflashNoTrainingProgress", "DflashCudaOOM", "DflashNotReady"} <= set(alerts)
    exported = CONTRACT_METRICS | {"dflash_data_prepare_progress_ratio", "process_start_time_seconds"}
    for name, expr in alerts.items():
        assert metric_families(expr) <= exported, name
    promtool = find_promtool()
    if promtool is None:
        pytest.skip("no promtool: install the Debian package `prometheus` (.ci/run does)")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
