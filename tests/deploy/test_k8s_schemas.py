"""Every manifest under docker/k8s against the schema the cluster would check it with, offline.

Core-API objects (the Deployment, Service, PersistentVolumeClaim and ConfigMap) go through
kubernetes-validate in strict mode, which rejects a field the API does not define: a misspelt field
fails here instead of being dropped or refused at apply time. They are checked against the oldest and
the newest Kubernetes versions whose schemas the pinned kubernetes-validate ships.

The Prometheus Operator's custom resources (PodMonitor, PrometheusRule) have no schema there: they are
checked against the structure of their CRDs (monitoring.coreos.com/v1) written out below, with every
field name of the CRD's spec at the levels the manifests use (an unknown one fails, as a misspelling
would) and the types, patterns and required fields of the fields the manifests set; their metadata
goes through the same Kubernetes ObjectMeta schema as the core objects'. The rule expressions are
promtool's (test_k8s_hardening.py).

Kustomization files are kustomize's input, not API objects: no schema applies; their test case is
skipped, saying so (test_deploy_files.py checks that they list every manifest).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from tests.deploy.test_deploy_files import K8S

# the oldest and the newest schema versions kubernetes-validate==1.37.0 ships
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")

# --------------------------------------------------------------------------- the custom resources' CRDs
DEFINITIONS = "https://kubernetes.io/api/_definitions.json"  # the $id of kubernetes-validate's definitions
OBJECT_META = {"$ref": f"{DEFINITIONS}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
# the CRDs' pattern for a Prometheus duration (interval, for, scrapeTimeout)
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def closed(properties: dict[str, Any], *, required: tuple[str, ...] = (), untyped: tuple[str, ...] = ()) -> dict:
    """An object schema with these properties and the CRD's other field names (`untyped`: any value), and no
    other field."""
    return {
        "type": "object",
        "properties": {**{key: {} for key in untyped}, **properties},
        "required": list(required),
        "additionalProperties": False,
    }


LABEL_SELECTOR = closed(
    {"matchLabels": STRING_MAP, "matchExpressions": {"type": "array"}},
)

POD_METRICS_ENDPOINT = closed(
    {
        "port": {"type": "string"},
        "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
    },
    untyped=(
        "authorization",
        "basicAuth",
        "bearerTokenSecret",
        "enableHttp2",
        "filterRunning",
        "followRedirects",
        "honorTimestamps",
        "metricRelabelings",
        "noProxy",
        "oauth2",
        "params",
        "proxyConnectHeader",
        "proxyFromEnvironment",
        "proxyUrl",
        "relabelings",
        "targetPort",
        "tlsConfig",
        "trackTimestampsStaleness",
    ),
)

POD_MONITOR_SPEC = closed(
    {
        "selector": LABEL_SELECTOR,
        "podMetricsEndpoints": {"type": "array", "items": POD_METRICS_ENDPOINT},
        "namespaceSelector": closed({"any": {"type": "boolean"}, "matchNames": {"type": "array"}}),
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
    },
    required=("selector",),
    untyped=(
        "attachMetadata",
        "bodySizeLimit",
        "convertClassicHistogramsToNHCB",
        "fallbackScrapeProtocol",
        "keepDroppedTargets",
        "labelLimit",
        "labelNameLengthLimit",
        "labelValueLengthLimit",
        "nativeHistogramBucketLimit",
        "nativeHistogramMinBucketFactor",
        "sampleLimit",
        "scrapeClass",
        "scrapeClassicHistograms",
        "scrapeNativeHistograms",
        "scrapeProtocols",
        "selectorMechanism",
        "targetLimit",
    ),
)

RULE = closed(
    {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": DURATION,
        "keep_firing_for": {**DURATION, "minLength": 1},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
    required=("expr",),
)

PROMETHEUS_RULE_SPEC = closed(
    {
        "groups": {
            "type": "array",
            "items": closed(
                {
                    "name": {"type": "string", "minLength": 1},
                    "interval": DURATION,
                    "rules": {"type": "array", "items": RULE},
                    "labels": STRING_MAP,
                    "limit": {"type": "integer"},
                    "query_offset": DURATION,
                },
                required=("name",),
                untyped=("partial_response_strategy",),
            ),
        }
    }
)


def custom_resource(kind: str, spec: dict) -> dict:
    return closed(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": OBJECT_META,
            "spec": spec,
        },
        required=("apiVersion", "kind", "metadata", "spec"),
    )


CUSTOM_RESOURCES = {
    "PodMonitor": custom_resource("PodMonitor", POD_MONITOR_SPEC),
    "PrometheusRule": custom_resource("PrometheusRule", PROMETHEUS_RULE_SPEC),
}
NOT_API_OBJECTS = {"Kustomization"}


def validate_custom_resource(doc: dict, version: str) -> None:
    """Raises jsonschema.ValidationError where `doc` departs from its CRD (CUSTOM_RESOURCES[kind])."""
    definitions = schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    registry: Registry = Registry().with_resource(DEFINITIONS, Resource.from_contents(definitions))
    jsonschema.Draft202012Validator(CUSTOM_RESOURCES[doc["kind"]], registry=registry).validate(doc)


def validate(doc: dict, version: str) -> None:
    if doc["kind"] in CUSTOM_RESOURCES:
        validate_custom_resource(doc, version)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


# --------------------------------------------------------------------------- the manifests
def manifests() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(K8S.rglob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _case_id(path: Path, doc: dict) -> str:
    return f"{path.relative_to(K8S)}:{doc['kind']}"


def deployment() -> dict:
    (doc,) = [doc for _, doc in manifests() if doc["kind"] == "Deployment"]
    return doc


def monitoring(kind: str) -> dict:
    (doc,) = [doc for _, doc in manifests() if doc["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path, doc", manifests(), ids=[_case_id(p, d) for p, d in manifests()])
def test_manifest_is_valid(path, doc, version):
    if doc["kind"] in NOT_API_OBJECTS:
        pytest.skip(f"{path.relative_to(K8S)}: a {doc['kind']} is kustomize's input, not an API object: no schema")
    try:
        validate(doc, version)
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{path.relative_to(K8S)}: {e.message}; a custom resource needs its CRD in CUSTOM_RESOURCES")
    except jsonschema.ValidationError as e:
        pytest.fail(f"{path.relative_to(K8S)} ({doc['kind']}), Kubernetes {version}: {e.message} at {e.json_path}")


def test_the_manifests_include_every_kind_checked():
    kinds = {doc["kind"] for _, doc in manifests()}
    assert kinds >= {"Deployment", "Service", "PersistentVolumeClaim", "ConfigMap"} | set(CUSTOM_RESOURCES)


def _misspelt(doc: dict, keys: list[str | int], wrong: str) -> dict:
    """A copy of `doc` whose field at `keys` (a path of keys and list indices) is renamed to `wrong`."""
    doc = copy.deepcopy(doc)
    parent = doc
    for key in keys[:-1]:
        parent = parent[key]
    parent[wrong] = parent.pop(keys[-1])
    return doc


CONTAINER = ["spec", "template", "spec", "containers", 0]


@pytest.mark.parametrize(
    "keys, wrong",
    [
        (["spec", "replicas"], "replica"),
        ([*CONTAINER, "readinessProbe"], "readynessProbe"),
        ([*CONTAINER, "securityContext", "readOnlyRootFilesystem"], "readOnlyRootFileSystem"),
        (["spec", "template", "spec", "volumes", 0, "persistentVolumeClaim"], "persistentVolumeClam"),
        (["metadata", "name"], "nmae"),
    ],
)
def test_a_misspelt_deployment_field_fails(keys, wrong):
    broken = _misspelt(deployment(), keys, wrong)
    for version in KUBERNETES_VERSIONS:
        with pytest.raises(jsonschema.ValidationError, match=wrong):
            validate(broken, version)


def test_a_wrongly_typed_deployment_field_fails():
    broken = deployment()
    broken["spec"]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError, match="one"):
        validate(broken, KUBERNETES_VERSIONS[-1])


@pytest.mark.parametrize(
    "kind, keys, wrong",
    [
        ("PodMonitor", ["spec", "podMetricsEndpoints"], "podMetricEndpoints"),
        ("PodMonitor", ["spec", "podMetricsEndpoints", 0, "interval"], "intervall"),
        ("PodMonitor", ["metadata", "labels"], "label"),
        ("PrometheusRule", ["spec", "groups", 0, "rules", 0, "annotations"], "annotation"),
        ("PrometheusRule", ["spec", "groups", 0, "rules", 1, "for"], "four"),
    ],
)
def test_a_misspelt_custom_resource_field_fails(kind, keys, wrong):
    with pytest.raises(jsonschema.ValidationError, match=wrong):
        validate(_misspelt(monitoring(kind), keys, wrong), KUBERNETES_VERSIONS[-1])


@pytest.mark.parametrize(
    "kind, keys, value",
    [
        ("PodMonitor", ["spec", "podMetricsEndpoints", 0, "interval"], "15 seconds"),
        ("PodMonitor", ["spec", "selector"], None),
        ("PrometheusRule", ["spec", "groups", 0, "rules", 1, "for"], "5 min"),
        ("PrometheusRule", ["spec", "groups", 0, "rules", 0, "expr"], None),
    ],
)
def test_a_bad_custom_resource_value_fails(kind, keys, value):
    """A duration Prometheus cannot read, and a required field left out (None)."""
    doc = copy.deepcopy(monitoring(kind))
    parent = doc
    for key in keys[:-1]:
        parent = parent[key]
    if value is None:
        del parent[keys[-1]]
    else:
        parent[keys[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(doc, KUBERNETES_VERSIONS[-1])
