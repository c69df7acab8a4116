"""What dispatches on a job's kind through the kinds table (dflash_core/kinds.py): a decoded JSON
body parsed as its kind's spec, the fields at fault named (pointing at the kind whose spec has a
field this one lacks), and a spec converted into its kind's engine job. The table names each kind's
spec model and conversion by module, so this sits above all of them (service.jobs.schemas,
regenerate_spec, continual_spec, admission), which never dispatch on a kind themselves."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from dflash_core.data.bounded import MAX_JSON_DEPTH, too_deep
from dflash_core.kinds import DEFAULT_KIND, KINDS, UnknownKind, kind

from .admission import JobOutputs
from .paths import Roots
from .schemas import SpecError, SpecModel, field_path
from .suggest import unknown_field_message


def spec_kind(spec: BaseModel) -> str:
    """The job kind a spec is of (a training spec has no `kind` field)."""
    return str(getattr(spec, "kind", DEFAULT_KIND))


def parse_spec(body: Any) -> SpecModel:
    """Validate a decoded JSON body as the spec of its `kind` (the kinds table's spec model; "train",
    the default, when absent); raises SpecError listing every problem."""
    if not isinstance(body, dict):
        raise SpecError("body", f"expected a JSON object, got {type(body).__name__}")
    # before anything walks the values recursively (validation, the fingerprint's JSON encoding)
    deep = [str(k) for k, v in body.items() if too_deep(v, MAX_JSON_DEPTH - 1)]
    if deep:
        raise SpecError(errors=[{"field": k, "message": f"nested deeper than {MAX_JSON_DEPTH} levels"} for k in deep])
    try:
        model: type[SpecModel] = kind(body.get("kind", DEFAULT_KIND)).spec_model()
    except UnknownKind as e:
        raise SpecError("kind", str(e)) from None
    # a kind's spec declares `kind` where it is required; the default kind's spec has none
    values = body if "kind" in model.model_fields else {k: v for k, v in body.items() if k != "kind"}
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise SpecError(errors=field_errors(e.errors(), model)) from None


def field_errors(errors: Iterable[Mapping[str, Any]], model: type[BaseModel] | None = None) -> list[dict[str, str]]:
    """pydantic's errors (locations already relative to the spec or the request) as [{field,
    message}], our own SpecErrors unwrapped; an unknown top-level field gets a suggestion from
    `model`'s fields."""
    out: list[dict[str, str]] = []
    for e in errors:
        ctx_error = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_error, SpecError):
            out.extend(ctx_error.errors)
            continue
        loc = tuple(e.get("loc", ()))
        name = field_path(loc) or "body"
        if e.get("type") == "extra_forbidden" and model is not None:
            # a top-level field: suggest one of the spec's (a nested one has no fields of its own here)
            unknown = str(loc[-1])
            fields = model.model_fields if len(loc) == 1 else ()
            out.append({"field": name, "message": unknown_field_message(unknown, fields, other_kind(model, unknown))})
        else:
            out.append({"field": name, "message": e.get("msg", "invalid")})
    return out


def other_kind(model: type[BaseModel], name: str) -> str | None:
    """The job kind whose spec has the field `name` when `model`'s has not: a train spec given a
    regeneration's `max_new_tokens` is pointed at `"kind": "regenerate"`, and back."""
    for entry in KINDS:
        other = entry.spec_model()
        if other is not model and name in other.model_fields and name not in model.model_fields:
            return entry.name
    return None


def to_engine_job(spec: SpecModel, job_id: str, roots: Roots, job_outputs: JobOutputs | None = None):
    """The engine's job for this spec, every path absolute and checked (its kind's conversion)."""
    return kind(spec_kind(spec)).converter()(spec, job_id, roots, job_outputs)
