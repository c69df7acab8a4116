"""The DFlash drafter (block diffusion draft model), read alongside the paper.

A drafter predicts B-1 tokens in parallel after an anchor token. Its input is the embedding of
[anchor, MASK, ..., MASK]; its only view of the past is the target's hidden states ("context
features") of a few target layers, fused by `fc` + `hidden_norm`. Each layer is a Qwen3 decoder
layer whose attention takes Q from the block and K, V from cat[context, block]; context never
enters the residual stream. Embedding and LM head are the target's, frozen, and live outside.

Parameter names equal the checkpoint keys of the reference `DFlashDraftModel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import DrafterConfig
from .fp8 import Fp8Head, linear_products

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # weight in the activation dtype: fp32 master weights under bf16 autocast must not
        # promote the activations (q, k, v of one attention call share a dtype)
        return self.weight.to(dtype) * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """The drafter's RoPE, computed as the reference drafter computes it: transformers'
    `Qwen3RotaryEmbedding` over the drafter's Qwen3 config (the one its checkpoint's config.json
    holds), so every RoPE type transformers implements (`ROPE_INIT_FUNCTIONS`: linear, dynamic,
    yarn, longrope, llama3) is the runtimes' own, and cos/sin carry its attention_scaling.

    inv_freq and the scaling are computed once, here, and stay fixed: the step's graph sees
    constants, whatever the shapes. For "dynamic" and "longrope" these are the values the
    reference uses for sequences within `DrafterConfig.rope_position_limit` (the engine keeps
    its training shapes there); it recomputes them only past that limit."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        inv_freq, scaling = rope_frequencies(cfg)
        # on the default device, like the module's parameters (the caller may build it under
        # `with torch.device(...)`); computed on the CPU, so every device gets the same values
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        self.attention_scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [1, 1, T, head_dim] for integer positions [T]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # in fp32, before the cast, as the reference scales
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype)[None, None], sin.to(dtype)[None, None]


def qwen3_rope_config(cfg: DrafterConfig):
    """The transformers Qwen3Config fields that decide the drafter's RoPE (and nothing else)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters),
    )


def rope_frequencies(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32 on the CPU, attention_scaling) of the reference drafter's
    rotary embedding at init."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    with torch.device("cpu"):
        rotary = Qwen3RotaryEmbedding(qwen3_rope_config(cfg))
    inv_freq = rotary.inv_freq.detach().float()
    if inv_freq.shape != (cfg.head_dim // 2,):
        raise ValueError(
            f"RoPE {cfg.rope_parameters} gives {inv_freq.shape[0]} frequencies for head_dim {cfg.head_dim}"
        )
    return inv_freq, float(rotary.attention_scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [1, Q, H] normed block states
        context: torch.Tensor,  # [1, S, H] fused target features
        rope_q: tuple[torch.Tensor, torch.Tensor],  # block positions
        rope_k: tuple[torch.Tensor, torch.Tensor],  # context positions then block positions
        attend: Attend,
    ) -> torch.Tensor:
        q_len, ctx_len = x.shape[1], context.shape[1]
        # K, V of cat[context, block], concatenated after the projection (a 4x narrower copy); the
        # five projections as one group, so that FP8 casts each input and weight once
        q, k_ctx, k_blk, v_ctx, v_blk = linear_products(
            (x, context),
            ((self.q_proj, 0), (self.k_proj, 1), (self.k_proj, 0), (self.v_proj, 1), (self.v_proj, 0)),
        )
        q = self.q_norm(q.view(1, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_len = ctx_len + q_len
        k = torch.cat([k_ctx, k_blk], dim=1).view(1, kv_len, self.num_kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = torch.cat([v_ctx, v_blk], dim=1).view(1, kv_len, self.num_kv_heads, self.head_dim)
        v = v.transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        out = attend(q, k, v)  # [1, Hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(1, q_len, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_products((x,), ((self.gate_proj, 0), (self.up_proj, 0)))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, context, rope_q, rope_k, attend):
        h = h + self.self_attn(self.input_layernorm(h), context, rope_q, rope_k, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


def run_layer(layer: DecoderLayer, h, context, rope_q, rope_k, attend) -> torch.Tensor:
    """One decoder layer called as a free function. Compiled once (`torch.compile(run_layer)`),
    the same compiled code serves every layer, since parameters are graph inputs: a cold compile
    costs one layer's graph, not the whole stack's (the first layer's too: `input_with_grad`)."""
    return layer(h, context, rope_q, rope_k, attend)


def input_with_grad(h: torch.Tensor) -> torch.Tensor:
    """The first layer's input as one that takes a gradient, where gradients are on, for a
    compiled layer function: dynamo guards on whether an input takes a gradient, and the block
    embeddings (frozen) take none where every later layer's input does, so the first layer would
    be a second graph of its own, traced at every start and compiled at every cold one. Nothing
    reads that gradient; computing it adds the first layer's norm and residual input gradient (a
    row reduction and elementwise ops), and it is held, as the graph's other buffers, for as long
    as the step's loss is."""
    if not torch.is_grad_enabled() or h.requires_grad:
        return h
    return h.detach().requires_grad_()


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_target_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        cfg.recipe_spec.hooks().attach_heads(self, cfg)  # DSpark's Markov and confidence heads

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic init (normal linears, unit norms) drawn on the parameters' device (a
        billion CPU draws take tens of seconds). Values depend on seed and device type; replicas
        are made identical by copying one replica's weights, not by drawing again."""
        init_drafter_weights(self.named_parameters(), seed, std)

    def forward(
        self,
        block_embeds: torch.Tensor,  # [1, Q, H] embedding of [anchor, MASK...] per block
        target_features: torch.Tensor,  # [1, S, n*H] captured target layers, in order
        block_positions: torch.Tensor,  # [Q] position id of every block token
        context_positions: torch.Tensor,  # [S] position id of every context token
        attend: Attend,
        layer_fn: Callable[..., torch.Tensor] = run_layer,
    ) -> torch.Tensor:
        """Final normed hidden states of the block tokens, [1, Q, H]. layer_fn: `run_layer` or a
        compiled `run_layer`."""
        dtype = block_embeds.dtype
        context = self.hidden_norm(self.fc(target_features.to(dtype)))
        rope_q = self.rotary(block_positions, dtype)
        rope_k = self.rotary(torch.cat([context_positions, block_positions]), dtype)
        h = block_embeds if layer_fn is run_layer else input_with_grad(block_embeds)
        for layer in self.layers:
            h = layer_fn(layer, h, context, rope_q, rope_k, attend)
        return self.norm(h)


@torch.no_grad()
def init_drafter_weights(named_weights, seed: int, std: float = 0.02) -> None:
    """DFlashDrafter.init_weights over (name, tensor) pairs in parameter order: also the fp32
    master copies a replica keeps beside bf16 working weights, so both draw the same values."""
    named_weights = list(named_weights)
    gen = torch.Generator(device=named_weights[0][1].device).manual_seed(seed)
    for name, p in named_weights:
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.fill_(1.0)
        elif name in ("markov_head.markov_w2.weight", "confidence_head.proj.bias"):
            p.zero_()  # DSpark starts as its DFlash backbone: no Markov bias, confidence 1/2
        else:
            p.normal_(0.0, std, generator=gen)


@dataclass
class FrozenHead:
    """The target's embedding and LM head weights, shared read-only by drafters on a device."""

    embed_weight: torch.Tensor  # [V, H]
    lm_head_weight: torch.Tensor  # [V, H]
    # the lm_head quantized once for the FP8 loss kernel (a replica with precision fp8 sets it)
    lm_head_fp8: Fp8Head | None = None

    def lm_head_for(self, loss_kernel: str) -> torch.Tensor | Fp8Head:
        """The lm_head operand the loss kernel takes (step.loss.LOSS_KERNELS)."""
        if loss_kernel != "triton_fp8":
            return self.lm_head_weight
        if self.lm_head_fp8 is None:
            raise ValueError("the triton_fp8 loss kernel needs the head's FP8 lm_head (fp8.quantize_head)")
        return self.lm_head_fp8

    def to(self, device, dtype) -> FrozenHead:
        # plain tensors, not the target's nn.Parameters: the compiled loss sees the same input
        # types whether or not the drafter shares the target's device
        return FrozenHead(self.embed_weight.detach().to(device, dtype), self.lm_head_weight.detach().to(device, dtype))
