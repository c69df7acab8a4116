"""What the engine is built with (the user's choices) and one training job.

`EngineConfig` holds only real choices: which target, which devices, the fixed training shapes,
the drafter's size, where the compile cache lives, and the two precisions that change the numbers
trained on (`precision`: FP8 GEMMs in the drafter step; `target_precision`: the target run in FP8,
which changes the features the drafter learns from). How the step runs on those devices
(attention kernel, what is compiled, the loss kernel, the working weights' dtype) is derived from
the devices by `step_plan`, never configured; `debug_eager` is the one escape from it.

The daemon's config file nests this model as its `[engine]` table, so the schema is written once.
Importing this module imports neither torch nor transformers: the daemon validates its config
before it pays for those imports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import ShapeConfig
from ..confine import UnsafeFile, read_regular, resolved_under
from ..data.tokenize import ChatTemplate
from ..recipes import Layout, layout_named, recipe_named
from .api import JobError

Device = Annotated[str, Field(pattern=r"^(cpu|cuda(:\d+)?)$")]


class EngineConfig(BaseModel):
    """The engine's settings; fixed for the life of the process. Unset devices are chosen from the
    host when the engine is built (`dflash_core.devices.default_devices`)."""

    model_config = ConfigDict(extra="forbid")

    target_path: Path | None = Field(
        None, description="HF model directory of the target (with its tokenizer); unset: the embedded tiny target"
    )
    target_random_init: bool = Field(
        False,
        description="build target_path's architecture with random weights: sizing and throughput dry runs "
        "without the weights",
    )
    target_devices: list[Device | list[Device]] | None = Field(
        None,
        min_length=1,
        description="one target copy per entry; an entry that is a list splits that copy's layers over those "
        "devices (a target larger than one GPU)",
    )
    drafter_devices: list[Device] | None = Field(None, min_length=1, description="one drafter replica per entry")
    seq_len: int = Field(512, ge=2, description="packed context tokens per micro-batch")
    num_anchors: int = Field(64, ge=1, description="blocks per micro-batch")
    block_size: int = Field(
        8,
        ge=2,
        description="tokens per block: the anchor and mask tokens; a block drafts block_size - 1 tokens in the "
        "fill_in layout, block_size in anchor_first",
    )
    drafter_layers: int = Field(2, ge=1, description="decoder layers of the drafter")
    drafter_intermediate_size: int | None = Field(None, ge=1, description="MLP width; unset: the target's")
    drafter_sliding_window: int | None = Field(
        None,
        ge=2,
        description="the drafter's layers attend within this many positions (exported as sliding_attention "
        "layers with this sliding_window); unset: full attention",
    )
    target_layer_ids: list[int] | None = Field(
        None, min_length=1, description="target layers whose outputs feed the drafter; unset: the DFlash rule"
    )
    mask_token: str | None = Field(
        None, description="the block's mask token; unset: the tokenizer's mask token, else <|mask|> added"
    )
    teacher: bool = Field(
        False,
        description="run the target to its final norm and train with the objective step, so jobs may distil "
        "the target's distribution (loss kl / tv / mixes) or use D-PACE position weights; off: the DFlash "
        "block CE step only, the target stopping at its deepest captured layer",
    )
    recipe: Literal["dflash", "dspark"] = Field(
        "dflash",
        description="the drafter recipe the engine warms: dflash (block CE, fill_in blocks), or dspark (Markov and "
        "confidence heads, DeepSpec's public recipe: anchor_first blocks of 7, 0.1 CE + 0.9 L1 + 1.0 confidence "
        "with position decay gamma 4; implies teacher)",
    )
    layout: Literal["fill_in", "anchor_first"] | None = Field(
        None,
        description="which token each block slot predicts: fill_in (slot 0 holds the anchor, a block drafts "
        "block_size - 1 tokens; z-lab and SpecForge serve DFlash so) or anchor_first (slot k predicts the token "
        "k + 1 after the anchor, a block drafts block_size tokens; DSpark as DeepSpec, speculators, vLLM and "
        "SGLang serve it); unset: the recipe's (dflash fill_in, dspark anchor_first). Every checkpoint states it "
        "(config.json sample_from_anchor)",
    )
    markov_rank: int | None = Field(
        None, ge=1, description="dspark: rank of the Markov head; unset: 256, capped for small vocabularies"
    )
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field(
        "vanilla",
        description="dspark: the Markov head (vanilla: a previous-token bias; gated: gated by the hidden state; "
        "rnn: a recurrence over the block)",
    )
    inductor_cache_dir: Path | None = Field(
        None, description="torch.compile's cache; unset: <data_dir>/inductor-cache (an exported variable wins)"
    )
    generate_slots: int | None = Field(
        None, ge=1, le=4096, description="sequences a regeneration job decodes at once; unset: from the memory left"
    )
    generate_max_len: int | None = Field(
        None,
        ge=2,
        description="cache positions per sequence (prompt plus new tokens) of a regeneration; unset: seq_len",
    )
    precision: Literal["bf16", "fp8"] = Field(
        "bf16",
        description="the drafter step's GEMMs: bf16, or fp8 (tensorwise-scaled e4m3 forward, e5m2 gradients, for "
        "the drafter's linear layers and the frozen lm_head in the loss; fp32 masters and optimizer as with "
        "bf16). fp8 needs GPUs with FP8 matmuls (compute capability 8.9 or newer) and GEMM widths that are "
        "multiples of 16",
    )
    target_precision: Literal["as_loaded", "fp8"] = Field(
        "as_loaded",
        description="the target's weights: as the checkpoint stores them (an FP8 checkpoint runs in FP8), or fp8 "
        "(a bf16 target quantized to fine-grained FP8 at load: the features then are those of an FP8-served "
        "target, not of the checkpoint's weights); fp8 needs GPUs with compute capability 8.9 or newer",
    )
    debug_eager: bool = Field(
        False,
        description="run the step without torch.compile or hand-written kernels (SDPA with a dense mask, fp32 "
        "weights): slow, for debugging a compile problem",
    )

    @model_validator(mode="after")
    def _recipe_defaults(self) -> EngineConfig:
        """A recipe's fixed block size (dspark: 7, the public DSpark configs) unless set, then it
        must be that; the teacher on where its default loss reads the target's distribution; the
        settings only a recipe with heads takes refused for one without."""
        recipe = recipe_named(self.recipe)
        if recipe.block_size is not None:
            if "block_size" in self.model_fields_set and self.block_size != recipe.block_size:
                raise ValueError(
                    f"block_size: the {recipe.name} recipe drafts blocks of {recipe.block_size} (its public "
                    f"configs); got {self.block_size}. Leave block_size unset or set it to {recipe.block_size}"
                )
            self.block_size = recipe.block_size
        if recipe.teacher:
            self.teacher = True
        if "markov_rank" not in recipe.settings and (
            self.markov_rank is not None or self.markov_head_type != "vanilla"
        ):
            field = "markov_rank" if self.markov_rank is not None else "markov_head_type"
            raise ValueError(f'{field}: only the dspark recipe has a Markov head (set recipe = "dspark")')
        return self

    @property
    def block_layout(self) -> Layout:
        """The layout the engine trains: the configured one, else the recipe's."""
        return layout_named(self.layout) if self.layout else recipe_named(self.recipe).layout

    @property
    def draft_length(self) -> int:
        """Tokens one block drafts (the block positions the per-position statistics have)."""
        return self.block_layout.drafted(self.block_size)

    @model_validator(mode="after")
    def _fp8_needs_the_compiled_step(self) -> EngineConfig:
        if self.debug_eager and self.precision == "fp8":
            raise ValueError('precision: "fp8" runs the compiled CUDA step; debug_eager runs fp32 eager')
        return self

    @field_validator("target_path", "inductor_cache_dir")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    @property
    def shape(self) -> ShapeConfig:
        return ShapeConfig(seq_len=self.seq_len, num_anchors=self.num_anchors, block_size=self.block_size)


@dataclass(frozen=True)
class StepPlan:
    """How the drafter step runs on a set of drafter devices: derived from the devices.

    attention: "flex" (compiled flex_attention with a BlockMask) or "dense" (SDPA with a boolean
        mask: flex_attention has no backward on the CPU).
    compiled: one decoder layer, the BlockMask construction and the loss chunks are compiled.
    loss: how the lm_head + CE chunks run ("triton", "compiled" or "eager"; step.loss).
    working_weights: "bf16" (bf16 copies of the weight matrices for the GEMMs, fp32 masters in the
        optimizer and checkpoints; needs the Triton AdamW) or "fp32" (the masters themselves).
    precision: "bf16" or "fp8" (the drafter's linear layers as tensorwise-scaled FP8 GEMMs; the
        loss is then "triton_fp8"): the user's `precision`, checked against the devices.
    """

    attention: str
    compiled: bool
    loss: str
    working_weights: str
    precision: str = "bf16"


CPU_PLAN = StepPlan(attention="dense", compiled=False, loss="eager", working_weights="fp32")


def step_plan(drafter_devices: list[str], debug_eager: bool = False, precision: str = "bf16") -> StepPlan:
    """The fastest step the devices run: on CUDA compiled flex attention, and where Triton
    imports, the Triton CE kernel and bf16 working weights; the eager dense path elsewhere (any
    CPU drafter makes the whole plan CPU: replicas must compute the same function). precision
    "fp8" raises ValueError (naming the setting) where a device has no FP8 matmuls."""
    if precision == "fp8":
        from ..fp8 import check_fp8_devices

        check_fp8_devices(drafter_devices, "precision")
        if debug_eager:
            raise ValueError('precision: "fp8" runs the compiled CUDA step; debug_eager runs fp32 eager')
    if debug_eager or not all(d.startswith("cuda") for d in drafter_devices):
        return CPU_PLAN
    from .optim import TritonAdamW  # None where Triton is missing or its kernels do not import

    if TritonAdamW is None:
        if precision == "fp8":
            raise ValueError('precision: "fp8" needs Triton (its loss kernel and AdamW), which could not be imported')
        return StepPlan(attention="flex", compiled=True, loss="compiled", working_weights="fp32")
    if precision == "fp8":
        return StepPlan(attention="flex", compiled=True, loss="triton_fp8", working_weights="bf16", precision="fp8")
    return StepPlan(attention="flex", compiled=True, loss="triton", working_weights="bf16")


@dataclass
class TrainJob:
    """One training run on the warm engine (the service validates and fills this)."""

    datasets: list[str]
    output_dir: str
    steps: int | None = None
    epochs: float | None = None
    learning_rate: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    grad_accum: int = 1
    loss_gamma: float | None = None
    # the objective (step.objectives): {term: weight} (None: the DFlash CE), position weights
    loss: dict[str, float] | None = None
    position_weights: str = "decay"
    dpace_alpha: float = 0.5
    recipe: str | None = None  # must equal the engine's (None = take the engine's)
    seed: int = 0
    checkpoint_interval: int = 100
    keep_checkpoints: int = 3
    init_from: str | None = None
    skip_bad_lines: bool = False
    chat_template: str | None = None  # a Jinja template file; None: the tokenizer's template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # options the template reads
    # model.safetensors of each checkpoint: "auto" (the target's declared dtype), "fp32" or "bf16"
    export_dtype: str = "auto"
    # where reads and writes must stay when they happen (the service's roots; empty: unconfined)
    dataset_roots: list[str] = field(default_factory=list)
    output_roots: list[str] = field(default_factory=list)
    # acceptance-length evaluation (held-out prompts)
    eval_prompts: str | None = None
    eval_fraction: float = 0.0
    eval_interval: int = 0
    eval_max_prompts: int = 16
    eval_max_new_tokens: int = 48
    # shapes: must equal the warmed engine's (None = take the engine's)
    seq_len: int | None = None
    num_anchors: int | None = None
    block_size: int | None = None

    def output_path(self) -> Path:
        return Path(self.output_dir)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (how rank 0 sends a job to the other ranks)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainJob:
        """The inverse of to_dict; keys this version does not know (a job stored by another) are dropped."""
        known = set(cls.__dataclass_fields__)
        fields: dict[str, Any] = {k: tuple(v) if k == "adam_betas" else v for k, v in values.items() if k in known}
        return cls(**fields)


MAX_TEMPLATE_BYTES = 1 << 20  # a chat template is a few KiB of Jinja


def job_template(job: TrainJob) -> ChatTemplate:
    path = resolved_under(job.chat_template, job.dataset_roots, "chat_template") if job.chat_template else None
    text = None
    if path is not None:
        # a regular file, bounded while reading: it may have grown or been replaced (by a FIFO
        # that would block the job) since submission
        try:
            raw = read_regular(path, MAX_TEMPLATE_BYTES, "chat_template")
        except UnsafeFile as e:
            raise JobError(str(e), "chat_template") from None
        text = raw.decode("utf-8")
    return ChatTemplate.of(text, job.chat_template_kwargs)
