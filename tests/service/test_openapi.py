"""The served /openapi.json says what the daemon does: checked by reading it, and by a schemathesis
run (every check: status codes, content types, headers, response bodies, auth, positive and
negative data, unsupported methods) against a real daemon whose reads and writes need a token."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_core.kinds import DEFAULT_KIND, KINDS
from service.jobs.schemas import JobSpec
from tests.service.harness import Daemon

TOKEN = "schema-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SCHEMATHESIS_CONFIG = """
# a schema-valid spec may still name files that do not exist, or shapes the warmed engine does not
# have: the job spec is checked against the filesystem and the engine, beyond what a schema says
[[operations]]
include-path = "/jobs"
include-method = "POST"
[operations.checks.positive_data_acceptance]
expected-statuses = ["2xx", "401", "403", "404", "409", "422", "429"]

# a repeated query parameter cannot carry a negative example: what is generated as a boolean or a
# number reaches the daemon as the string it serializes to ("false"), a valid event kind to filter on
[[operations]]
include-name = "GET /jobs/{{job_id}}/events"
checks.negative_data_rejection.enabled = false

# half the generated job ids name a job that exists (a finished one), so that the job routes'
# answers for real jobs are checked too, not only their 404s
[dictionaries.jobs]
values = ["{job_id}"]

[parameters]
"path.job_id" = {{ dictionary = "jobs", probability = 0.5 }}
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("openapi")
    (root / "cwd").mkdir()
    config = root / "dflash.toml"
    config.write_text(f'data_dir = "{root / "data"}"\nauth_token = "{TOKEN}"\nprotect_reads = true\n')
    d = Daemon(config, root / "data", root / "cwd").start()
    d.http.headers.update(AUTH)
    d.wait_ready()
    yield d
    d.close()


@pytest.fixture(scope="module")
def schema(daemon) -> dict:
    r = daemon.http.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def _media(response: dict) -> set[str]:
    return set(response.get("content", {}))


def test_submit_documents_its_body_and_every_answer(schema):
    submit = schema["paths"]["/jobs"]["post"]
    body = submit["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/JobSpec"}
    spec = schema["components"]["schemas"]["JobSpec"]
    assert set(spec["properties"]) == set(JobSpec.model_fields)
    assert spec["required"] == ["datasets"] and spec["additionalProperties"] is False
    for entry in KINDS:  # every other kind's spec: a component, named in the body's description
        name = entry.spec.rpartition(":")[2]
        if entry.name != DEFAULT_KIND:
            assert f'"kind": "{entry.name}" is a {name}' in body["description"]
            assert schema["components"]["schemas"][name]["properties"]["kind"]["const"] == entry.name
    assert set(submit["responses"]) == {
        "200",
        "202",
        "400",
        "401",
        "403",
        "409",
        "413",
        "415",
        "421",
        "422",
        "431",
        "503",
    }
    assert submit["security"] == [{"bearer": []}]
    refs = {
        code: r["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        for code, r in submit["responses"].items()
    }
    assert refs["202"] == refs["200"] == "Job"
    assert refs["409"] == "SubmissionConflict" and refs["422"] == "InvalidRequest"
    assert {refs[c] for c in ("400", "401", "403", "413", "415", "421", "431", "503")} == {"Error"}


def test_every_operation_documents_the_guard(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert {"400", "421", "431"} <= codes, (method, path)
            if method == "post":
                assert {"401", "403", "413", "415"} <= codes, (method, path)
            elif path not in ("/healthz", "/livez", "/metrics"):
                assert "401" in codes and operation["security"] == [{"bearer": []}], (method, path)
            else:
                assert "401" not in codes and "security" not in operation, (method, path)
            for code, response in operation["responses"].items():
                if int(code) >= 400:
                    assert _media(response) == {"application/json"}, (method, path, code)
            if "422" in codes:
                assert operation["responses"]["422"]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/InvalidRequest"
                }
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_metrics_is_text_and_events_are_ndjson(schema):
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]
    assert _media(metrics) == {"text/plain"}
    events = schema["paths"]["/jobs/{job_id}/events"]["get"]["responses"]
    assert _media(events["200"]) == {"application/x-ndjson"}
    assert events["200"]["content"]["application/x-ndjson"]["itemSchema"] == {"$ref": "#/components/schemas/Event"}
    assert "Retry-After" in events["429"]["headers"]


def _check(schema: dict, name: str, instance) -> None:
    """`instance` is valid against the served schema's component `name` (JSON Schema 2020-12)."""
    import jsonschema_rs  # schemathesis's validator

    jsonschema_rs.validate({"$ref": f"#/components/schemas/{name}", "components": schema["components"]}, instance)


def test_answers_match_their_documented_bodies(daemon, schema):
    """What schemathesis cannot reach with generated data: a queued job, a conflict, an event stream."""
    spec = {"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 2, "submission_id": "doc-1"}
    _check(schema, "JobSpec", spec)
    r = daemon.http.post("/jobs", json=spec)
    assert r.status_code == 202
    _check(schema, "Job", r.json())
    conflict = daemon.http.post("/jobs", json={**spec, "steps": 3})
    assert conflict.status_code == 409
    _check(schema, "SubmissionConflict", conflict.json())
    job = daemon.wait_terminal(r.json()["id"])
    _check(schema, "Job", job)
    for entry in KINDS:  # a job of every kind, as GET /jobs/{id} answers for it
        _check(schema, "Job", {**job, "kind": entry.name})
    with pytest.raises(ValueError):
        _check(schema, "Job", {**job, "kind": "bogus"})
    _check(schema, "JobList", daemon.http.get("/jobs").json())
    for event in daemon.events(job["id"]):
        _check(schema, "Event", event)
    invalid = daemon.http.post("/jobs", json={"datasets": [], "steps": 0, "bogus": 1})
    assert invalid.status_code == 422
    _check(schema, "InvalidRequest", invalid.json())
    _check(schema, "Health", daemon.http.get("/healthz").json())
    _check(schema, "Liveness", daemon.http.get("/livez").json())
    for bad in (
        {"datasets": ["a", "a"], "steps": 1},
        {"datasets": ["a"]},
        {"datasets": ["a"], "steps": 1, "epochs": 1},
    ):
        with pytest.raises(ValueError):  # what the validator refuses, the schema refuses too
            _check(schema, "JobSpec", bad)


@pytest.mark.slow  # generates and sends hundreds of requests
def test_schemathesis_finds_no_difference(daemon, tmp_path):
    finished = daemon.submit({"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 2})
    assert daemon.wait_terminal(finished["id"])["state"] == "SUCCEEDED"
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG.format(job_id=finished["id"]))
    executable = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    command = [
        executable,
        "--config-file",
        str(config),
        "run",
        f"{daemon.url}/openapi.json",
        "--header",
        f"Authorization: Bearer {TOKEN}",
        "--max-examples",
        "30",
        "--seed",
        "20261201",
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--generation-database",
        "none",
        "--no-color",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-20000:]
    assert "Failures" not in output.split("SUMMARY")[-1], output[-5000:]
