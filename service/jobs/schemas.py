"""What a client may submit: a job spec (SpecModel, what every kind's spec shares, and JobSpec, the
training spec; each other kind's spec model is named in the kinds table, dflash_core/kinds.py, and
a body is parsed as its kind's by service.jobs.by_kind.parse_spec), and SpecError, the one error
that names the fields at fault (HTTP 422)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
# Characters refused in a job's name, submission_id and output_dir: C0/C1 controls (NUL, escape sequences,
# newlines) and the bidirectional controls that reorder what a terminal shows ("job-\u202egnp.exe"
# reads as "job-exe.png"); `dflash-trainer status` prints names as they are.
UNPRINTABLE = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_UNPRINTABLE_RE = re.compile(f"[{UNPRINTABLE}]")
PRINTABLE_PATTERN = f"^[^{UNPRINTABLE}]*$"


class SpecError(ValueError):
    """An invalid request: every problem as {field, message}, the field named as the client wrote
    it (`datasets[0]`, `body`, a query parameter). Raised inside a pydantic validator it travels in
    the validation error's context, and comes out whole. `subject` is what the request sent, as the
    422's detail names it."""

    def __init__(
        self,
        field_name: str = "body",
        message: str = "",
        *,
        errors: list[dict[str, str]] | None = None,
        subject: str = "job spec",
    ):
        self.errors = errors if errors is not None else [{"field": field_name, "message": message}]
        self.subject = subject
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in self.errors))

    @property
    def field(self) -> str:
        return self.errors[0]["field"]

    @property
    def message(self) -> str:
        return self.errors[0]["message"]


def _document_checks(schema: dict[str, Any]) -> None:
    """What SpecModel's validators check, where JSON Schema can say it."""
    for name in ("name", "submission_id", "output_dir"):
        if name not in schema["properties"]:
            continue
        for variant in schema["properties"][name].get("anyOf", [schema["properties"][name]]):
            if variant.get("type") == "string":
                variant["pattern"] = PRINTABLE_PATTERN
    schema["properties"]["datasets"]["uniqueItems"] = True


class SpecModel(BaseModel):
    """What every kind of job spec shares: unknown fields are refused, so a typo never silently
    falls back to a default; names are printable; a chat_template_kwargs of bounded size; no
    dataset twice; and the fingerprint that makes a resubmission idempotent."""

    # strict: "7", true or 5.0 are not a step count; a JSON number is still fine for a float field
    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        str_strip_whitespace=True,
        strict=True,
        json_schema_extra=lambda schema, cls: _document_checks(schema),
    )
    if TYPE_CHECKING:  # every kind declares these, each where it belongs in its own field order
        name: str | None
        submission_id: str | None
        datasets: list[str]
        chat_template_kwargs: dict[str, Any]

    @field_validator("name", "submission_id", "output_dir", mode="before", check_fields=False)
    @classmethod
    def _printable(cls, value: Any, info) -> Any:
        """Before whitespace is stripped: a trailing newline is refused too."""
        if isinstance(value, str) and (found := _UNPRINTABLE_RE.search(value)):
            raise SpecError(
                info.field_name,
                f"contains U+{ord(found.group()):04X}, a control or bidirectional-override character; use "
                "printable text",
            )
        return value

    @model_validator(mode="after")
    def _shared_checks(self) -> Any:
        if len(canonical_json(self.chat_template_kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise SpecError("chat_template_kwargs", f"larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
        try:  # an unpaired surrogate escape: no answer or job list holding it could be encoded
            json.dumps(self.chat_template_kwargs, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise SpecError("chat_template_kwargs", "a string holds an unpaired UTF-16 surrogate: not text") from None
        duplicates = sorted({d for d in self.datasets if self.datasets.count(d) > 1})
        if duplicates:
            raise SpecError("datasets", f"listed more than once: {', '.join(duplicates)}")
        return self

    def fingerprint(self) -> str:
        """Identity of the spec for idempotent resubmission: defaults filled in, keys sorted."""
        return hashlib.sha256(canonical_json(self.model_dump(mode="json")).encode()).hexdigest()


def _document_job_checks(schema: dict[str, Any]) -> None:
    _document_checks(schema)
    schema["oneOf"] = [  # steps or epochs, one of them (JobSpec._checks)
        {"required": ["steps"], "properties": {"steps": {"type": "integer"}}},
        {"required": ["epochs"], "properties": {"epochs": {"type": "number"}}},
    ]
    schema["properties"]["adam_betas"]["items"].update(minimum=0, exclusiveMaximum=1)


class JobSpec(SpecModel):
    """A training job as submitted over HTTP (POST /jobs). Unknown fields are rejected, so a typo
    never silently falls back to a default."""

    model_config = ConfigDict(json_schema_extra=lambda schema, cls: _document_job_checks(schema))

    name: str | None = Field(None, max_length=200)
    submission_id: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="idempotency key: resubmitting the same spec returns the same job",
    )
    datasets: list[str] = Field(
        min_length=1,
        max_length=1024,
        description="conversation datasets: JSONL (or .jsonl.gz), JSON array or parquet files, directories of such shards, "
        "datasets.save_to_disk directories, or builtin://train|heldout",
    )
    steps: int | None = Field(None, ge=1, le=10**9)
    epochs: float | None = Field(None, gt=0, le=10**6)
    # bounded so that no setting alone can make the weights non-finite: lr * weight_decay <= 1 keeps
    # AdamW's decay factor in [0, 1]; a loss_gamma below float32's range makes the position weights NaN
    learning_rate: float = Field(6e-4, gt=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="max gradient norm; 0 disables clipping")
    adam_betas: list[float] = Field([0.9, 0.95], min_length=2, max_length=2)
    grad_accum: int = Field(1, ge=1, le=4096)
    loss_gamma: float | None = Field(None, ge=0.01, le=1e6, description="position-weight decay; default by block size")
    loss: Any = Field(
        None,
        description='"ce" (default), "kl", "tv", or a weighted mix such as {"ce": 0.1, "tv": 0.9}; kl and tv '
        'need a daemon started with [engine] teacher = true; "conf" (a dspark daemon) weights the confidence head; '
        '"l1" is 2 tv (DeepSpec\'s scale). Default: ce, or on a dspark daemon 0.1 ce + 0.9 l1 + 1.0 conf',
    )
    position_weights: Literal["decay", "dpace"] = Field(
        "decay", description="decay: exp(-(k-1)/loss_gamma); dpace: D-PACE weights (teacher daemon)"
    )
    dpace_alpha: float = Field(0.5, ge=0, le=1, description="D-PACE smoothing alpha")
    recipe: Literal["dflash", "dspark"] | None = Field(
        None, description="must equal the daemon's [engine] recipe; unset: the daemon's"
    )
    seed: int = Field(0, ge=0, le=2**32 - 1)
    output_dir: str | None = Field(None, description="default <data_dir>/jobs/<job id>")
    checkpoint_interval: int = Field(100, ge=1, le=10**9)
    keep_checkpoints: int = Field(3, ge=1, le=10**6)
    init_from: str | None = Field(None, description="drafter checkpoint to start from")
    skip_bad_lines: bool = False
    chat_template: str | None = Field(None, description="a Jinja chat template file; default: the tokenizer's")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None,
        description="experiment trackers for this job (TensorBoard event files under output_dir/tensorboard; "
        "wandb or mlflow where installed); default: the daemon's report_to",
    )
    export_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="dtype of each checkpoint's model.safetensors; auto: the target's (bf16 for a bf16 target); "
        "resume always has the fp32 masters",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description='options the chat template reads, e.g. {"enable_thinking": false}'
    )
    eval_prompts: str | None = Field(None, description="JSONL of held-out prompts for acceptance length")
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    eval_interval: int = Field(0, ge=0, le=10**9)
    eval_max_prompts: int = Field(16, ge=1, le=100_000)
    eval_max_new_tokens: int = Field(48, ge=1, le=32_768)
    seq_len: int | None = Field(None, ge=2, le=10**8)
    num_anchors: int | None = Field(None, ge=1, le=10**8)
    block_size: int | None = Field(None, ge=2, le=10**4)

    # `loss` as {term: weight}, parsed once by check_training_fields; the spec keeps `loss` as given
    _loss_mix: dict[str, float] | None = PrivateAttr(None)

    @property
    def loss_mix(self) -> dict[str, float] | None:
        if self._loss_mix is None and self.loss is not None:  # a spec built without validation
            check_training_fields(self)
        return dict(self._loss_mix) if self._loss_mix is not None else None

    @model_validator(mode="after")
    def _checks(self) -> JobSpec:
        if self.steps is None and self.epochs is None:
            raise SpecError("steps", "give steps or epochs")
        if self.steps is not None and self.epochs is not None:
            raise SpecError("epochs", "give steps or epochs, not both")
        check_training_fields(self)
        return self


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def field_path(loc: tuple) -> str:
    """('datasets', 0) -> 'datasets[0]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def check_training_fields(spec: Any) -> None:
    """The checks every kind that trains shares: its loss mix and its Adam betas."""
    if spec.loss is not None:
        from dflash_core.step.objective_spec import parse_loss

        try:
            spec._loss_mix = parse_loss(spec.loss)
        except ValueError as e:
            raise SpecError("loss", str(e)) from None
    for i, b in enumerate(spec.adam_betas):
        if not 0 <= b < 1:
            raise SpecError(f"adam_betas[{i}]", f"{b} must lie in [0, 1)")
