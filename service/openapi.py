"""The served /openapi.json: the routes' own declarations, plus what FastAPI cannot see from them:
the answers of service.http_guard, which every request passes first and which depend on the
method and on this daemon's tokens; error answers as JSON whatever the route streams; and the
schemas a route names by reference only (the regeneration spec, an event line), and the job spec
as its model writes it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from dflash_core.kinds import DEFAULT_KIND, KINDS

from . import api_models as models
from .config import ServiceConfig
from .http_guard import MAX_BODY_BYTES, SAFE_METHODS, UNGUARDED_READS
from .jobs.schemas import JobSpec

# what every request may be answered by the guard, before any route runs
_GUARD = {
    "400": "a malformed request (e.g. two Host headers)",
    "421": "the Host header names a server this daemon is not (allowed_hosts)",
    "431": "request line and headers over 16 KiB",
}
_GUARD_MUTATING = {
    "403": "a browser page of another origin (allowed_origins)",
    "413": f"a body of more than {MAX_BODY_BYTES} bytes",
    "415": "a body not sent as Content-Type: application/json (or application/x-ndjson)",
}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _add_schema(schemas: dict[str, Any], name: str, model: type[BaseModel]) -> None:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[name] = schema


def guarded_openapi(app: FastAPI, config: ServiceConfig) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    # the body's schema as the model itself writes it (FastAPI's rendering of a body validated by a
    # function differs in form: float bounds on integers, no null defaults)
    _add_schema(schemas, "JobSpec", JobSpec)
    for entry in KINDS:  # a body with "kind": <its name>, named as its model is
        if entry.name != DEFAULT_KIND:
            model = entry.spec_model()
            _add_schema(schemas, model.__name__, model)
    _add_schema(schemas, "Event", models.Event)  # one line of an event stream
    guarded = False
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            for status, response in responses.items():  # errors are JSON, whatever the route streams
                content = response.get("content")
                if int(status) >= 400 and content and "application/json" not in content:
                    response["content"] = {"application/json": next(iter(content.values()))}
            mutating = method.upper() not in SAFE_METHODS
            for status, description in (_GUARD | (_GUARD_MUTATING if mutating else {})).items():
                responses[status] = _error(description)
            if (mutating and config.auth_token is not None) or (
                not mutating and config.reads_protected and path not in UNGUARDED_READS
            ):
                guarded = True
                operation["security"] = [{"bearer": []}]
                responses["401"] = _error("no bearer token, or a wrong one")
            operation["responses"] = dict(sorted(responses.items()))
    if guarded:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = schema
    return schema
