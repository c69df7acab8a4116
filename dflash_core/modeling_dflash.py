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

Block layout (config.json `sample_from_anchor`): false, fill_in (z-lab, SpecForge): slot 0 holds
the anchor and slot k drafts the token k after it, B - 1 drafts per block; true, anchor_first
(DSpark as DeepSpec, speculators, vLLM and SGLang serve it): slot k drafts the token k + 1 after
the anchor, B drafts per block. A config without the field was written fill_in.

`spec_generate(target, input_ids, max_new_tokens, stop_token_ids, temperature, top_p, top_k)`
decodes with the target verifying each drafted block, as the z-lab reference's does: greedy
(temperature 0) gives exactly the target's greedy output; with temperature > 0, speculative
rejection sampling gives exactly the target's sampling distribution. It returns the prompt and
the generated ids, [1, n], ending at the first stop token or after max_new_tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config
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


def _window_mask(context_len: int, q_len: int, window: int, device) -> torch.Tensor:
    """A sliding-window drafter's mask of one block [q_len, context_len + q_len], the rule it was
    trained with: block position o sees the context positions p >= context_len + o - (window - 1)
    and its own block causally."""
    o = torch.arange(q_len, device=device).view(-1, 1)
    kv = torch.arange(context_len + q_len, device=device).view(1, -1)
    ctx = (kv < context_len) & (kv >= context_len + o - (window - 1))
    own = (kv >= context_len) & (kv - context_len <= o)
    return ctx | own


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
        window = getattr(self.config, "sliding_window", None)
        if attention_mask is None and window and getattr(self.config, "use_sliding_window", False):
            attention_mask = _window_mask(context.shape[1], q_len, int(window), noise_embedding.device)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        rope_k = (cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype))
        rope_q = (rope_k[0][:, :, -q_len:], rope_k[1][:, :, -q_len:])
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, context, rope_q, rope_k, attention_mask)
        return self.norm(h)

    def _dflash(self, name: str, default=None):
        return (getattr(self.config, "dflash_config", None) or {}).get(name, getattr(self.config, name, default))

    def _first_slot(self) -> int:
        """The block's first drafting slot: 0 anchor_first, 1 fill_in."""
        value = getattr(self.config, "sample_from_anchor", None)
        if value is None:
            value = self._dflash("sample_from_anchor", False)
        return 0 if value else 1

    def draft_tokens(self, hidden: torch.Tensor, head: nn.Module, anchor_ids: torch.Tensor, sampling: _Sampling):
        """The drafts of one block from its drafting slots' hidden states [1, n, H]: (tokens
        [1, n], the distribution each was drawn from [1, n, V], None when greedy). Each slot on
        its own; DSparkDraftModel drafts left to right."""
        logits = head(hidden).float()
        probs = sampling.probs(logits)
        return (logits.argmax(-1) if probs is None else _draw(probs)), probs

    @torch.no_grad()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> torch.Tensor:
        """Speculative decoding of one sequence (input_ids [1, n]) with `target`, a transformers
        causal LM (the one this drafter was trained for). input_ids may also be what a tokenizer's
        `apply_chat_template(..., return_tensors="pt")` returns (a BatchEncoding in transformers 5)."""
        if not isinstance(input_ids, torch.Tensor) and "input_ids" in input_ids:
            input_ids = input_ids["input_ids"]
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, n], got {tuple(input_ids.shape)}")
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature and top_k must be >= 0 and top_p in (0, 1]")
        self.eval()
        layer_ids = list(self._dflash("target_layer_ids"))
        block = int(self._dflash("block_size", 16))
        mask_id = int(self._dflash("mask_token_id"))
        scale = float(self._dflash("input_embedding_scale", 1.0))
        sampling = _Sampling(temperature, top_p, top_k)
        device, prompt_len = input_ids.device, input_ids.shape[1]
        max_len = prompt_len + max_new_tokens
        stops = torch.tensor(sorted(set(stop_token_ids or [])), dtype=torch.long, device=device)
        runner = _TargetRunner(target, layer_ids)
        out = torch.full((1, max_len + 1), mask_id, dtype=torch.long, device=device)
        out[:, :prompt_len] = input_ids
        logits, context = runner.forward(input_ids, 0)
        out[0, prompt_len] = sampling.sample(logits[:, -1])[0]
        start = prompt_len  # index of the newest token: generated, not yet seen by the target
        stopped = bool(torch.isin(out[0, start], stops))
        embed = target.get_input_embeddings().weight  # type: ignore[operator]
        head = target.get_output_embeddings()  # type: ignore[operator]
        first = self._first_slot()
        while start + 1 < max_len and not stopped:
            drafts = min(block - first, max_len - start - 1)
            ids = out[:, start : start + drafts + first].clone()  # the anchor, then mask tokens
            noise = F.embedding(ids, embed) * scale
            positions = torch.arange(start + ids.shape[1], device=device).unsqueeze(0)
            hidden = self(noise.to(self.dtype), context.to(self.dtype), positions)[:, first:]
            tokens, draft_probs = self.draft_tokens(hidden.to(embed.dtype), head, ids[:, 0], sampling)
            ids = torch.cat([ids[:, :1], tokens], dim=1)
            logits, features = runner.forward(ids, start)
            accepted, bonus = sampling.verify(ids[0, 1:], draft_probs, logits[0].float())
            out[0, start : start + accepted + 1] = ids[0, : accepted + 1]
            out[0, start + accepted + 1] = bonus
            produced = min(accepted + 1, max_len - start - 1)
            hits = torch.isin(out[0, start + 1 : start + produced + 1], stops).nonzero()
            if hits.numel():
                produced, stopped = int(hits[0, 0]) + 1, True
            context = torch.cat([context, features[:, :produced]], dim=1)
            start += produced
            runner.keep(start, out)
        return out[:, : min(start + 1, max_len)]


class _TargetRunner:
    """The target with a KV cache of the accepted tokens; returns logits and the captured layers'
    hidden states (`hidden_states[id + 1]`, as the drafter was trained on) of the tokens it is given."""

    def __init__(self, target: nn.Module, layer_ids: list[int]):
        self.target, self.layer_ids = target, layer_ids
        self.cache = self._new_cache()

    def _new_cache(self):
        try:
            return DynamicCache(config=self.target.config)
        except TypeError:  # transformers before caches took the config
            return DynamicCache()

    def forward(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        output = self.target(
            input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True, output_hidden_states=True
        )
        features = torch.cat([output.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return output.logits, features

    def keep(self, length: int, tokens: torch.Tensor) -> None:
        """Drop the cache entries past `length` (the rejected drafts). A cache with sliding-window
        layers cannot be cut (they keep no more than the window, so the entries before the cut
        are gone): it is rebuilt from the accepted tokens, one prefill per block, correct if slower."""
        remove = self.cache.get_seq_length() - length
        if remove <= 0:
            return
        if any(getattr(layer, "is_sliding", False) for layer in getattr(self.cache, "layers", ())):
            self.cache = self._new_cache()
            self.forward(tokens[:, :length], 0)
            return
        self.cache.crop(-remove)  # a negative count: tokens to drop, in every transformers version


class _Sampling:
    def __init__(self, temperature: float, top_p: float, top_k: int):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k

    def probs(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The sampling distribution of logits [..., V] (None when greedy): temperature, then the
        top_k most likely tokens, then the smallest set whose mass reaches top_p."""
        if self.temperature <= 0:
            return None
        scores = logits.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        probs = self.probs(logits)
        return logits.argmax(-1) if probs is None else _draw(probs)

    def verify(self, drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor) -> tuple[int, int]:
        """(drafts accepted, the token after them) for drafts [k] verified by the target's logits
        [k + 1, V]. Greedy: the longest prefix equal to the target's argmax. Sampling: draft i is
        kept with probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw
        from max(p - q, 0), renormalised, so every emitted token is distributed as the target's."""
        target_probs = self.probs(logits)
        if target_probs is None or draft_probs is None:
            posterior = logits.argmax(-1)
            accepted = int((drafts == posterior[:-1]).int().cumprod(0).sum())
            return accepted, int(posterior[accepted])
        q = draft_probs[0] if draft_probs.dim() == 3 else draft_probs
        for i, token in enumerate(drafts.tolist()):
            p_x, q_x = target_probs[i, token], q[i, token]
            if torch.rand((), device=logits.device) * q_x < p_x:  # u < p/q, without dividing by q
                continue
            residual = (target_probs[i] - q[i]).clamp_min(0)
            residual = residual if residual.sum() > 0 else target_probs[i]
            return i, int(_draw(residual / residual.sum()))
        return len(drafts), int(_draw(target_probs[len(drafts)]))


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [..., V]."""
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


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

    def draft_tokens(self, hidden: torch.Tensor, head: nn.Module, anchor_ids: torch.Tensor, sampling: _Sampling):
        """Left to right: each slot's logits plus the Markov bias of the token drafted before it
        (the anchor for the first), as DeepSpec's `sample_block_tokens`."""
        markov = self.markov_head
        base = head(hidden).float()
        prev, tokens, dists = anchor_ids, [], []
        state = hidden.new_zeros(hidden.shape[0], markov.markov_w1.embedding_dim)
        for k in range(hidden.shape[1]):
            emb = markov.markov_w1(prev).to(hidden.dtype)
            latent, state = markov.step(state, emb, hidden[:, k])
            logits = base[:, k] + markov.markov_w2(latent.to(markov.markov_w2.weight.dtype)).float()
            probs = sampling.probs(logits)
            prev = logits.argmax(-1) if probs is None else _draw(probs)
            tokens.append(prev)
            dists.append(probs)
        stacked = None if dists[0] is None else torch.stack(dists, dim=1)  # type: ignore[arg-type]
        return torch.stack(tokens, dim=1), stacked

    @torch.no_grad()
    def draft_block(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, anchor_token_ids: torch.Tensor):
        """hidden [B, Q, H] (this model's output for one block), lm_head_weight [V, H] (the
        target's), anchor_token_ids [B]: greedy tokens of the block's drafting slots (Q - 1 fill_in,
        Q anchor_first) and the confidence (sigmoid) of each."""
        head = self.markov_head
        first = self._first_slot()
        base = hidden[:, first:].to(lm_head_weight.dtype) @ lm_head_weight.t()
        prev, tokens, conf = anchor_token_ids, [], []
        state = hidden.new_zeros(hidden.shape[0], head.markov_w1.embedding_dim)
        for k in range(base.shape[1]):
            emb = head.markov_w1(prev).to(hidden.dtype)
            latent, state = head.step(state, emb, hidden[:, first + k])
            logits = base[:, k].float() + head.markov_w2(latent.to(head.markov_w2.weight.dtype)).float()
            c = self.confidence_head(torch.cat([hidden[:, first + k], emb], dim=-1))
            prev = logits.argmax(-1)
            tokens.append(prev)
            conf.append(torch.sigmoid(c.float()))
        return torch.stack(tokens, 1), torch.stack(conf, 1)
