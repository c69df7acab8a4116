"""DFlash drafter for `transformers.AutoModel.from_pretrained(dir, trust_remote_code=True)`.

Every checkpoint directory carries a copy of this file next to its config.json (whose `auto_map`
names it), so a serving stack or a notebook loads the drafter without dflash-trainer installed:
it imports only torch and transformers.

The model: the target's hidden states of a few layers (`target_hidden`, [B, S, n*H]) are fused by
`fc` and `hidden_norm` into the context; the block (`noise_embedding`, [B, Q, H]: the embedding
of the anchor token followed by mask tokens, taken from the target's embedding) runs through
Qwen3 decoder layers whose attention takes its queries from the block and its keys and values
from cat[context, block]; the context never enters the residual stream. RoPE rotates the keys
over the context positions then the block positions, and the queries over the block positions
(`position_ids`, [B, S + Q]). Returns the final normed hidden states of the block, [B, Q, H],
for the target's LM head. Attention is bidirectional within what it is given: an inference
caller passes the context before the anchor and one block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, context, rope_q, rope_k, attention_mask):
        b, q_len, _ = x.shape
        kv_len = context.shape[1] + q_len
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(x)], dim=1).view(b, kv_len, self.kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = torch.cat([self.v_proj(context), self.v_proj(x)], dim=1).view(b, kv_len, self.kv_heads, self.head_dim)
        v = v.transpose(1, 2)
        q, k = _rope(q, *rope_q), _rope(k, *rope_k)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, h, context, rope_q, rope_k, attention_mask):
        h = h + self.self_attn(self.input_layernorm(h), context, rope_q, rope_k, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]  # noqa: RUF012 - transformers' own attribute type

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        features = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """noise_embedding [B, Q, H], target_hidden [B, S, n*H], position_ids [B, S + Q] (context
        then block); attention_mask: an optional boolean or additive [B, 1, Q, S + Q] mask."""
        dtype = noise_embedding.dtype
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        q_len = noise_embedding.shape[1]
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        rope_k = (cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype))
        rope_q = (rope_k[0][:, :, -q_len:], rope_k[1][:, :, -q_len:])
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, context, rope_q, rope_k, attention_mask)
        return self.norm(h)


class DSparkMarkovHead(nn.Module):
    """A previous-token logit bias markov_w2(latent): latent = markov_w1[prev] (vanilla), gated by
    the hidden state (gated), or a recurrence over the block (rnn)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        elif kind != "vanilla":
            raise ValueError(f"markov_head_type {kind!r}: vanilla, gated or rnn")

    def step(self, state: torch.Tensor, emb: torch.Tensor, hidden: torch.Tensor):
        """(latent, next state) of one position."""
        if self.kind == "vanilla":
            return emb, state
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1))) * emb, state
        gate, cand, out = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(cand)


class DSparkConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraftModel(DFlashDraftModel):
    """DSpark: the DFlash drafter with a Markov head (a previous-token logit bias inside the block,
    `dflash_config.markov_rank` and `markov_head_type`) and a confidence head on [hidden state,
    Markov embedding] whose sigmoid predicts the chance the target accepts a drafted position.
    Parameter names as SpecForge's DSparkDraftModel. `draft_block` drafts a block left to right
    with the bias."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        rank = int(config.dflash_config["markov_rank"])
        kind = str(config.dflash_config.get("markov_head_type", "vanilla"))
        self.markov_head = DSparkMarkovHead(config.vocab_size, rank, config.hidden_size, kind)
        self.confidence_head = DSparkConfidenceHead(config.hidden_size + rank)
        self.post_init()

    @torch.no_grad()
    def draft_block(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, anchor_token_ids: torch.Tensor):
        """hidden [B, Q, H] (this model's output for one block), lm_head_weight [V, H] (the
        target's), anchor_token_ids [B]: greedy tokens of positions 1..Q-1 [B, Q-1] and the
        confidence (sigmoid) of each."""
        head = self.markov_head
        base = hidden[:, 1:].to(lm_head_weight.dtype) @ lm_head_weight.t()
        prev, tokens, conf = anchor_token_ids, [], []
        state = hidden.new_zeros(hidden.shape[0], head.markov_w1.embedding_dim)
        for k in range(base.shape[1]):
            emb = head.markov_w1(prev).to(hidden.dtype)
            latent, state = head.step(state, emb, hidden[:, 1 + k])
            logits = base[:, k].float() + head.markov_w2(latent.to(head.markov_w2.weight.dtype)).float()
            c = self.confidence_head(torch.cat([hidden[:, 1 + k], emb], dim=-1))
            prev = logits.argmax(-1)
            tokens.append(prev)
            conf.append(torch.sigmoid(c.float()))
        return torch.stack(tokens, 1), torch.stack(conf, 1)
