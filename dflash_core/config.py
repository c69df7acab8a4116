"""Typed configuration of the drafter architecture and of the fixed training shapes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Which target decoder layers feed the drafter (the DFlash reference rule).

    Qwen3-8B (36 layers) with 5 draft layers -> [1, 9, 17, 25, 33].
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


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
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2 (an anchor and one drafted token)")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if self.rope_scaling not in (None, {}) and self.rope_scaling.get(
            "rope_type", self.rope_scaling.get("type")
        ) not in (None, "default"):
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is not supported; only default RoPE is")

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

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
    ) -> DrafterConfig:
        """Drafter widths follow the target's, as in the reference drafters."""
        num_target_layers = int(target_config.num_hidden_layers)
        ids = (
            list(target_layer_ids) if target_layer_ids else build_target_layer_ids(num_target_layers, num_hidden_layers)
        )
        bad = [i for i in ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's {num_target_layers} layers")
        heads = int(target_config.num_attention_heads)
        head_dim = int(getattr(target_config, "head_dim", None) or target_config.hidden_size // heads)
        rope_theta = getattr(target_config, "rope_theta", None)
        rope_params = getattr(target_config, "rope_parameters", None)
        if rope_theta is None and isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta")
        rope_scaling = getattr(target_config, "rope_scaling", None)
        if isinstance(rope_params, dict) and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
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
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling or None,
            max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 40960)),
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
    "build_target_layer_ids",
    "default_loss_gamma",
]
