"""The multi-host Kubernetes manifests (docker/k8s/multihost): a StatefulSet whose ordinal is the
torchrun rank, as hardened as the single-host Deployment, the rendezvous on rank 0's stable name,
and the job API on rank 0 only."""

from __future__ import annotations

import re

import yaml

from tests.deploy.test_deploy_files import K8S

MULTIHOST = K8S / "multihost"


def docs() -> list[dict]:
    return [d for f in sorted(MULTIHOST.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def kind(name: str) -> list[dict]:
    return [d for d in docs() if d.get("kind") == name]


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((MULTIHOST / "kustomization.yaml").read_text())
    local = sorted(r for r in kustomization["resources"] if not r.startswith("../"))
    assert local == sorted(p.name for p in MULTIHOST.glob("*.yaml") if p.name != "kustomization.yaml")
    assert all((MULTIHOST / r).exists() for r in kustomization["resources"])


def test_statefulset_launches_one_rank_per_pod_with_the_ordinal_as_rank():
    (sts,) = kind("StatefulSet")
    spec = sts["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    command = " ".join(container["command"] + container["args"])
    assert spec["podManagementPolicy"] == "Parallel"
    assert int(env["NNODES"]) == spec["replicas"], "NNODES must equal the replica count"
    assert "torchrun" in command and "--nproc-per-node 1" in command
    assert '--node-rank "${HOSTNAME##*-}"' in command  # the StatefulSet ordinal
    master = re.search(r'--master-addr "([^"]+)"', command)
    assert master and master.group(1).startswith(f"{sts['metadata']['name']}-0.{spec['serviceName']}.")
    assert "-m service.cli serve" in command
    assert env["DFLASH_DISTRIBUTED_TIMEOUT_SECONDS"]
    probes = {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"startupProbe": "/healthz", "readinessProbe": "/healthz", "livenessProbe": "/livez"}


def test_statefulset_pods_meet_the_restricted_pod_security_standard():
    (sts,) = kind("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    psc, csc = pod["securityContext"], container["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
    assert csc["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/lib/dflash-trainer", "/tmp", "/home/dflash/.cache"} <= mounts
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]


def test_services_give_the_rendezvous_a_stable_name_and_the_api_to_rank_0():
    (sts,) = kind("StatefulSet")
    services = {s["metadata"]["name"]: s for s in kind("Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    api = next(s for name, s in services.items() if name != sts["spec"]["serviceName"])
    selector = api["spec"]["selector"]
    assert selector["statefulset.kubernetes.io/pod-name"] == f"{sts['metadata']['name']}-0"
    assert all(labels[k] == v for k, v in selector.items() if k != "statefulset.kubernetes.io/pod-name")
    allowed = next(
        e["value"]
        for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
        if e["name"] == "DFLASH_ALLOWED_HOSTS"
    )
    assert api["metadata"]["name"] in allowed.split(",")


def test_network_policy_admits_the_rendezvous_only_from_the_group():
    """The rendezvous store is unauthenticated and torch binds it on every interface: only the group's
    own pods may reach any port but HTTP."""
    (sts,) = kind("StatefulSet")
    (policy,) = kind("NetworkPolicy")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    from_group, http = spec["ingress"]
    (peer,) = from_group["from"]
    assert peer["podSelector"]["matchLabels"].items() <= labels.items() and "ports" not in from_group
    ports = sts["spec"]["template"]["spec"]["containers"][0]["ports"]
    http_port = next(p["containerPort"] for p in ports if p["name"] == "http")
    rendezvous = next(p["containerPort"] for p in ports if p["name"] == "rendezvous")
    assert "from" not in http and [p["port"] for p in http["ports"]] == [http_port] != [rendezvous]
