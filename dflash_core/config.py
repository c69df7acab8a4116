"""Typed configuration of the drafter architecture and of the fixed training shapes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .recipes import Layout, Recipe, layout_named, recipe_named


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Which target decoder layers feed the drafter (the DFlash reference rule).

    Qwen3-8B (36 layers) with 5 draft layers -> [1, 9, 17, 25, 33]. The layers are distinct: a
    target too shallow for the rule's range (layers 1 to n - 3) has them spread over all its
    layers instead, and one with fewer layers than the drafter is a ValueError (a layer fed
    twice would be a drafter input that carries nothing new).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_draft_layers > num_target_layers:
        raise ValueError(
            f"a drafter of {num_draft_layers} layers needs as many distinct target layers; the target has "
            f"{num_target_layers}: use fewer drafter layers or give target_layer_ids"
        )
    for start, end in ((1, num_target_layers - 3), (0, num_target_layers - 1)):
        span = end - start
        ids = [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
        if span >= 0 and len(set(ids)) == len(ids):
            return ids
    raise AssertionError("unreachable: the whole range always holds distinct layers")


# RoPE variants the drafter takes from its target. The drafter computes them with transformers'
# own functions (`modeling_rope_utils.ROPE_INIT_FUNCTIONS`), as the reference drafter does, and
# runtimes that load the checkpoint (SGLang, vLLM, the z-lab reference) know each of them.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def drafter_rope(target_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a drafter for this target: the target's RoPE type and its
    parameters (rope_scaling None for default RoPE).

    Reads transformers' `rope_parameters` (the target's RoPE after transformers standardised it:
    a legacy `rope_scaling` / `rope_theta` / `original_max_position_embeddings` of config.json
    ends up there), else the legacy attributes. Per-layer-type RoPE (a dict per layer type) gives
    the full-attention layers' parameters: every drafter layer attends fully. The drafter is a
    Qwen3 model and rotates the whole head, so a target's `partial_rotary_factor` is left out (a
    Qwen3 config with it would not load into the runtimes' Qwen3 attention)."""
    params = getattr(target_config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        params = dict(getattr(target_config, "rope_scaling", None) or {})
        if getattr(target_config, "rope_theta", None) is not None:
            params.setdefault("rope_theta", target_config.rope_theta)
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    theta = params.pop("rope_theta", None)
    theta = float(theta if theta is not None else getattr(target_config, "rope_theta", None) or 10000.0)
    return theta, normalize_rope_scaling(params, theta)


def normalize_rope_scaling(scaling: dict[str, Any] | None, rope_theta: float) -> dict[str, Any] | None:
    """One spelling of a RoPE scaling dict: None for default RoPE, else `rope_type` (the legacy
    `type` key renamed) and the type's parameters, without `rope_theta` (kept beside it)."""
    if not scaling:
        return None
    d = dict(scaling)
    legacy = d.pop("type", None)
    rope_type = d.pop("rope_type", None) or legacy or "default"
    theta = d.pop("rope_theta", None)
    if theta is not None and float(theta) != float(rope_theta):
        raise ValueError(f"rope_scaling carries rope_theta {theta}, the config {rope_theta}")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    if "partial_rotary_factor" in d:
        raise ValueError("partial_rotary_factor is not supported: the drafter's Qwen3 layers rotate the whole head")
    return {"rope_type": rope_type, **d}


def default_loss_gamma(block_size: int) -> float:
    """Decay constant of the position weights: 7 for B=16, 5 for B=10, 4 for B=8 (the recipe)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, block_size * 7.0 / 16.0)


@dataclass(frozen=True)
class DrafterConfig:
    """Architecture of one DFlash drafter (Qwen3 decoder layers, width of the target)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # the target's RoPE type and its parameters (`rope_type`, `factor`, ...; see
    # normalize_rope_scaling); None: default RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    # what the target's embedding module multiplies its table by (parity.input_embedding_scale):
    # the block inputs are the table's rows times this, in training and in serving
    input_embedding_scale: float = 1.0
    # the mask token's text (SGLang resolves the mask by it where no id is given); it names
    # mask_token_id, so two configs differing only here describe the same drafter
    mask_token: str | None = field(default=None, compare=False)
    # every drafter layer attends within this window (sliding_attention; step.attention says
    # how); None: full attention
    sliding_window: int | None = None
    # "dflash", or "dspark": the DFlash backbone with DSpark's Markov head of this rank and its
    # confidence head (recipes/dspark.py)
    recipe: str = "dflash"
    markov_rank: int = 0
    markov_head_type: str = "vanilla"  # dspark: "vanilla", "gated" or "rnn"
    # which token each block slot predicts (recipes.base.Layout): "fill_in" or "anchor_first"
    layout: str = "fill_in"
    # the training micro-batch's anchor slots, where known (DeepSpec's model config carries it);
    # a training setting, not the drafter's architecture
    num_anchors: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2 (an anchor and one drafted token)")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        heads = recipe_named(self.recipe).heads  # raises for an unknown recipe
        layout_named(self.layout)
        if heads != (self.markov_rank > 0):
            raise ValueError(f"markov_rank must be > 0 exactly for a recipe with heads, got {self.markov_rank}")
        if self.markov_head_type not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov_head_type must be vanilla, gated or rnn, got {self.markov_head_type!r}")
        if self.markov_rank >= self.vocab_size:
            raise ValueError(f"markov_rank {self.markov_rank} must be below the vocabulary size {self.vocab_size}")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window {self.sliding_window} must be at least the block size {self.block_size}")
        object.__setattr__(self, "rope_scaling", normalize_rope_scaling(self.rope_scaling, self.rope_theta))

    @property
    def recipe_spec(self) -> Recipe:
        return recipe_named(self.recipe)

    @property
    def block_layout(self) -> Layout:
        return layout_named(self.layout)

    @property
    def draft_length(self) -> int:
        """Tokens one block drafts: B - 1 fill-in, B anchor-first."""
        return self.block_layout.drafted(self.block_size)

    @property
    def first_slot(self) -> int:
        """The block's first slot that predicts a token."""
        return self.block_layout.first_slot

    @property
    def layer_types(self) -> list[str]:
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return [kind] * self.num_hidden_layers

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers' `rope_parameters` of the drafter's Qwen3 config: theta, type, factors."""
        return {"rope_theta": self.rope_theta, "rope_type": self.rope_type, **(self.rope_scaling or {})}

    @property
    def rope_position_limit(self) -> int | None:
        """Positions (largest position id + 1) for which the drafter's fixed RoPE frequencies are
        the reference's; None: all.

        The drafter computes its frequencies once, for fixed shapes, as the reference's rotary
        embedding computes them at init. "dynamic" and "longrope" recompute them in the forward
        from the sequence's largest position: dynamic NTK raises the base once positions pass
        max_position_embeddings; longrope switches from short_factor to long_factor once they
        pass original_max_position_embeddings. Below those limits the init values are what the
        reference uses, so training must keep its positions below them."""
        if self.rope_type == "dynamic":
            return self.max_position_embeddings
        if self.rope_type == "longrope":
            assert self.rope_scaling is not None
            return int(self.rope_scaling.get("original_max_position_embeddings") or self.max_position_embeddings)
        return None

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        *,
        num_hidden_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        sliding_window: int | None = None,
        recipe: str = "dflash",
        markov_rank: int = 0,
        markov_head_type: str = "vanilla",
        layout: str | None = None,
    ) -> DrafterConfig:
        """Drafter widths follow the target's, as in the reference drafters."""
        num_target_layers = int(target_config.num_hidden_layers)
        ids = (
            list(target_layer_ids) if target_layer_ids else build_target_layer_ids(num_target_layers, num_hidden_layers)
        )
        bad = [i for i in ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's {num_target_layers} layers")
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"target_layer_ids {ids} name layer(s) {twice} more than once; each must be distinct")
        heads = int(target_config.num_attention_heads)
        head_dim = int(getattr(target_config, "head_dim", None) or target_config.hidden_size // heads)
        rope_theta, rope_scaling = drafter_rope(target_config)
        return cls(
            hidden_size=int(target_config.hidden_size),
            intermediate_size=int(intermediate_size or target_config.intermediate_size),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(target_config, "num_key_value_heads", heads)),
            head_dim=head_dim,
            vocab_size=int(target_config.vocab_size),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(ids),
            num_target_layers=num_target_layers,
            rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 40960)),
            sliding_window=sliding_window,
            recipe=recipe,
            markov_rank=markov_rank,
            markov_head_type=markov_head_type,
            layout=layout or recipe_named(recipe).layout.name,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d


@dataclass(frozen=True)
class ShapeConfig:
    """The fixed shapes of every micro-batch: the engine compiles for exactly these.

    seq_len   tokens of packed context per micro-batch (S)
    num_anchors  block slots per micro-batch (N); Q = N * block_size query tokens
    """

    seq_len: int
    num_anchors: int
    block_size: int

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError("seq_len must be at least 2")
        if self.num_anchors < 1:
            raise ValueError("num_anchors must be at least 1")
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2")

    @property
    def num_query_tokens(self) -> int:
        return self.num_anchors * self.block_size

    @property
    def kv_len(self) -> int:
        return self.seq_len + self.num_query_tokens


@dataclass(frozen=True)
class LossConfig:
    gamma: float | None = None  # None: default_loss_gamma(block_size)
    chunk_size: int = 2048  # query tokens per lm_head+CE chunk; bounds the logits buffer

    def resolved_gamma(self, block_size: int) -> float:
        return self.gamma if self.gamma is not None else default_loss_gamma(block_size)


__all__ = [
    "DrafterConfig",
    "LossConfig",
    "ShapeConfig",
    "ROPE_TYPES",
    "build_target_layer_ids",
    "default_loss_gamma",
    "drafter_rope",
    "normalize_rope_scaling",
]
