"""DSpark's torch hooks: a DFlash backbone with a low-rank Markov head and a confidence head
(arXiv 2607.05147; public definitions: DeepSpec `deepspec/modeling/dspark/`, SpecForge
`specforge/modeling/draft/dspark.py`, `DSparkDraftModel`). The recipe's plain values are in
dspark_settings.py.

Markov head: a previous-token logit bias inside the block,
    logits_k = lm_head(h_k) + markov_w2(latent_k),  e_k = markov_w1[prev_k],
markov_w1 an Embedding(vocab, r), markov_w2 a Linear(r, vocab) without bias, and latent_k by
`markov_head_type`: vanilla e_k; gated sigmoid(gate_proj([h_k, e_k])) * e_k; rnn a gated
recurrence over the block's positions (state_0 = 0; z = [state, e_k, h_k]; gate, candidate,
output = joint_proj(z) in three; latent_k = tanh(output); state <- g state + (1 - g) tanh(cand)).
In training prev_k is the true token before the one slot k predicts (the anchor for the first
predicting slot); at inference it is the token drafted by the slot before, so the block is
drafted left to right (`markov_draft`).
Confidence head (`AcceptRatePredictor`): a Linear(H + r, 1) on [h_k, markov_w1[prev_k]] whose
sigmoid predicts c* = 1 - TV(p_draft, p_target), the chance the target accepts position k's
draft; trained with BCE against the detached c*, then calibrated on held-out data (`calibrate`).
Loss: 0.1 CE + 0.9 L1 + 1.0 confidence BCE by default, L1 = sum |p_d - p_t| = 2 TV, every term
weighted by the decayed position weights (a job may set other weights).

Parameter names are the public class's: markov_head.markov_w1.weight,
markov_head.markov_w2.weight (gated: markov_head.gate_proj.*, rnn: markov_head.joint_proj.*),
confidence_head.proj.weight, confidence_head.proj.bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8 import FORWARD_DTYPE, Fp8Head, head_grad, head_logits, quantize
from ..step.inputs import RowLossInputs
from ..step.teacher import teacher_logits
from .dspark_settings import DSPARK_BLOCK_SIZE, DSPARK_GAMMA, DSPARK_LOSS, DSPARK_MARKOV_RANK, default_markov_rank

__all__ = ["DSPARK_BLOCK_SIZE", "DSPARK_GAMMA", "DSPARK_LOSS", "DSPARK_MARKOV_RANK", "OPS", "default_markov_rank"]


MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str = "vanilla"):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"markov_rank must be > 0, got {rank}")
        if kind not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {kind!r}")
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, state: torch.Tensor | None, emb: torch.Tensor, hidden: torch.Tensor):
        """One position: (its latent [.., r], the next state or None). emb and hidden in one dtype."""
        if self.kind == "vanilla":
            return emb, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1))) * emb, None
        assert state is not None
        gate, cand, out = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(cand)

    def latents(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Training: latents of every predicting position, emb and hidden [N, K, ...] (teacher
        forcing: emb of the true previous tokens); [N, K, r]."""
        if self.kind != "rnn":
            return self.step(None, emb, hidden)[0]
        state = torch.zeros_like(emb[:, 0])
        out = []
        for k in range(emb.shape[1]):
            latent, state = self.step(state, emb[:, k], hidden[:, k])
            out.append(latent)
        return torch.stack(out, dim=1)


class AcceptRatePredictor(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


def attach_heads(drafter: nn.Module, hidden_size: int, vocab_size: int, rank: int, kind: str = "vanilla") -> None:
    """Give a DFlash drafter the DSpark heads (the confidence head reads the Markov embedding)."""
    drafter.markov_head = MarkovHead(vocab_size, rank, hidden_size, kind)
    drafter.confidence_head = AcceptRatePredictor(hidden_size + rank)


def head_keys(kind: str = "vanilla") -> set[str]:
    keys = {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    extra = {"gated": "markov_head.gate_proj", "rnn": "markov_head.joint_proj"}.get(kind)
    return keys | ({f"{extra}.weight", f"{extra}.bias"} if extra else set())


# ----------------------------------------------------------------------------- training loss
class _MarkovObjective(torch.autograd.Function):
    """sum_rows w_row * (mix . terms_row) over chunks of rows, the drafter's logits carrying the
    Markov bias. The weights are known before the pass (decayed position weights), so each
    chunk's logits gradient is scaled by them at once and markov_w2's gradient (a sum over rows)
    is accumulated chunk by chunk: no [rows x vocab] tensor beyond one chunk.

    With an FP8 lm_head (fp8.Fp8Head, the kernel "triton_fp8") its two GEMMs run in FP8: the
    lm_head's logits come from the chunk's hidden states in e4m3 (a bf16 view without the padding
    columns, to which the Markov bias is added), and the kernel writes the gradient in FP8 for
    grad_h's GEMM beside the bf16 one over the logits. The Markov parts' GEMMs (the bias, and
    markov_w2's and the latents' gradients) stay in bf16: their inner or outer width is the
    Markov rank, which no shape check holds to FP8's multiples of 16, they cost about rank / H
    of the lm_head's GEMMs, and markov_w2's gradient needs the row weights inside its sum over
    rows, which the kernel's unweighted FP8 gradient does not carry (grad_h takes them after
    its GEMM, row by row)."""

    @staticmethod
    def forward(ctx, hidden, prev_emb, teacher, lm_head, w2, labels, mix, weights, chunk_size: int, kernel: str):
        from ..step.objectives import chunk_rows, logit_terms_function, teacher_lse_function

        fn = logit_terms_function(kernel)
        lse_fn = teacher_lse_function(kernel)
        fp8 = isinstance(lm_head, Fp8Head)
        need_grad = any(ctx.needs_input_grad[:2]) or ctx.needs_input_grad[4]
        dtype = torch.bfloat16 if fp8 else lm_head.dtype
        w2c = w2.to(dtype)
        rows = hidden.shape[0]
        terms = torch.empty(rows, 3, dtype=torch.float32, device=hidden.device)
        hits = torch.empty(rows, dtype=torch.bool, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad else None
        grad_e = torch.empty(prev_emb.shape, dtype=prev_emb.dtype, device=hidden.device) if need_grad else None
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=hidden.device) if need_grad else None
        chunk = chunk_rows(rows, chunk_size, kernel)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            e = prev_emb[start:end].to(dtype)
            h = hidden[start:end]
            base = head_logits(*quantize(h, FORWARD_DTYPE), lm_head) if fp8 else h.to(dtype) @ lm_head.t()
            zd = torch.addmm(base, e, w2c.t())
            zt = teacher.rows(start, end, lse_fn)
            if fp8:  # keep_grad: the bf16 gradient over zd beside the FP8 one for grad_h
                t, hit, grad8, grad_inv = fn(zd, zt, labels[start:end], mix, need_grad, lm_head.rows.shape[0], True)
                g = zd if need_grad else None
            else:
                t, hit, g = fn(zd, zt, labels[start:end], mix, need_grad)
            terms[start:end] = t
            hits[start:end] = hit
            if need_grad:
                assert grad_h is not None and grad_e is not None and grad_w2 is not None and g is not None
                w = weights[start:end].unsqueeze(1)
                g = g.mul_(w.to(g.dtype))
                if fp8:  # the rows' weights after the GEMM: (w g) W = w (g W) row by row
                    grad_h[start:end] = (head_grad(grad8, grad_inv, lm_head).float() * w).to(hidden.dtype)
                else:
                    grad_h[start:end] = (g @ lm_head).to(hidden.dtype)
                grad_e[start:end] = (g @ w2c).to(prev_emb.dtype)
                grad_w2 += (g.t() @ e).float()
        teacher.release()
        loss = ((terms @ mix) * weights).sum()
        if need_grad:
            ctx.save_for_backward(grad_h, grad_e, grad_w2)
        ctx.w2_dtype = w2.dtype
        ctx.mark_non_differentiable(terms, hits)
        return loss, terms, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_terms, _grad_hits):
        grad_h, grad_e, grad_w2 = ctx.saved_tensors
        s = grad_loss.float()
        return (
            (grad_h.float() * s).to(grad_h.dtype),
            (grad_e.float() * s).to(grad_e.dtype),
            None,
            None,
            (grad_w2 * s).to(ctx.w2_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def dspark_loss(drafter, inputs: RowLossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, terms [R, 3], argmax hits [R]) of the DSpark objective on the predicting rows of N
    blocks of D positions (in order): the weighted mean of the mixed terms (the objective's mix of
    ce, kl, tv) plus the objective's conf times the weighted mean of the confidence BCE, every row
    weighted by its detached position weight."""
    rows = inputs.rows
    prev = inputs.prev.reshape(-1)
    w = inputs.decayed.reshape(-1).detach().float()
    w = w / w.sum().clamp_min(1e-6)
    emb = drafter.markov_head.markov_w1(prev)
    k = inputs.decayed.shape[1]
    latent = drafter.markov_head.latents(
        emb.view(-1, k, emb.shape[-1]).to(rows.dtype), rows.view(-1, k, rows.shape[-1])
    ).reshape(-1, emb.shape[-1])
    loss, terms, hits = _MarkovObjective.apply(
        rows,
        latent,
        teacher_logits(inputs.teacher_rows, inputs.lm_head),
        inputs.lm_head,
        drafter.markov_head.markov_w2.weight,
        inputs.labels,
        inputs.objective.mix.float(),
        w,
        inputs.chunk_size,
        inputs.kernel,
    )
    conf_logit = drafter.confidence_head(torch.cat([rows, emb.to(rows.dtype)], dim=-1)).float()
    accept = (1.0 - terms[:, 2]).clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(conf_logit, accept, reduction="none")
    return loss + inputs.objective.conf * (bce * w).sum(), terms, hits


def reference_dspark_loss(drafter, inputs: RowLossInputs, latent: torch.Tensor) -> torch.Tensor:
    """Dense float64 reference of dspark_loss, for tests (the full [rows, vocab] logits; latent:
    the Markov latents of the rows, computed by the caller)."""
    rows, lm_head, mix = inputs.rows, inputs.lm_head, inputs.objective.mix
    assert isinstance(lm_head, torch.Tensor), "the dense reference takes the lm_head as a tensor"
    emb = drafter.markov_head.markov_w1(inputs.prev.reshape(-1)).double()
    zd = rows.double() @ lm_head.double().t() + latent.double() @ drafter.markov_head.markov_w2.weight.double().t()
    zt = teacher_logits(inputs.teacher_rows, lm_head).hidden_rows().double() @ lm_head.double().t()
    logp_d, logp_t = torch.log_softmax(zd, -1), torch.log_softmax(zt, -1)
    ce = F.nll_loss(logp_d, inputs.labels, reduction="none")
    kl = (logp_t.exp() * (logp_t - logp_d)).sum(-1)
    tv = 0.5 * (logp_d.exp() - logp_t.exp()).abs().sum(-1)
    weights = inputs.decayed.reshape(-1).double()
    w = weights / weights.sum().clamp_min(1e-6)
    main = ((mix[0] * ce + mix[1] * kl + mix[2] * tv) * w).sum()
    proj = drafter.confidence_head.proj
    conf = (torch.cat([rows.double(), emb], -1) @ proj.weight.double().t() + proj.bias.double()).squeeze(-1)
    bce = F.binary_cross_entropy_with_logits(conf, (1 - tv.detach()).clamp(0, 1), reduction="none")
    return main + inputs.objective.conf * (bce * w).sum()


# ----------------------------------------------------------------------------- inference
@torch.no_grad()
def markov_draft(
    drafter, lm_head: torch.Tensor, hidden: torch.Tensor, anchor_token: int
) -> tuple[list[int], list[float]]:
    """Greedy draft of one block left to right with the Markov bias (as the public
    `sample_block_tokens`; hidden: the block's predicting slots [D, H], the anchor the first
    previous token): (the D tokens, the confidence head's logit of each)."""
    head = drafter.markov_head
    base = hidden.to(lm_head.dtype) @ lm_head.t()  # [D, V]
    prev = torch.tensor([anchor_token], device=hidden.device)
    tokens, conf = [], []
    state = torch.zeros(1, head.markov_w1.embedding_dim, dtype=hidden.dtype, device=hidden.device)
    for k in range(base.shape[0]):
        emb = head.markov_w1(prev)  # [1, r]
        latent, state = head.step(state, emb.to(hidden.dtype), hidden[k : k + 1])
        logits = base[k].float() + head.markov_w2(latent.to(head.markov_w2.weight.dtype))[0].float()
        c = drafter.confidence_head(torch.cat([hidden[k : k + 1], emb.to(hidden.dtype)], -1)).float()
        tok = int(logits.argmax())
        tokens.append(tok)
        conf.append(float(c))
        prev = torch.tensor([tok], device=hidden.device)
    return tokens, conf


# ----------------------------------------------------------------------------- calibration
def calibrate(logits: torch.Tensor, accept: torch.Tensor, steps: int = 200) -> dict[str, float]:
    """Platt scaling of the confidence head on held-out positions: a, b minimising the BCE of
    sigmoid(a * logit + b) against the observed acceptance (1 accepted, 0 not); with the
    expected calibration error (10 bins) before and after."""
    x, y = logits.detach().double().flatten(), accept.detach().double().flatten()
    a = torch.ones((), dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([a, b], lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(a * x + b, y)
        loss.backward()
        return loss

    if x.numel():
        opt.step(closure)
    with torch.no_grad():
        before = expected_calibration_error(torch.sigmoid(x), y)
        after = expected_calibration_error(torch.sigmoid(a * x + b), y)
    return {
        "scale": float(a.detach()),
        "bias": float(b.detach()),
        "ece_before": before,
        "ece_after": after,
        "positions": int(x.numel()),
    }


def expected_calibration_error(prob: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> float:
    if prob.numel() == 0:
        return 0.0
    idx = (prob * bins).long().clamp(max=bins - 1)
    err = 0.0
    for i in range(bins):
        sel = idx == i
        if sel.any():
            err += float(sel.double().mean() * (prob[sel].mean() - outcome[sel].mean()).abs())
    return err


@torch.no_grad()
def markov_sample(
    drafter, lm_head: torch.Tensor, hidden: torch.Tensor, anchor_token: int, temperature: float, generator
) -> tuple[list[int], torch.Tensor]:
    """A block sampled left to right at `temperature` with the Markov bias (as the public
    `sample_block_tokens` with a temperature; hidden: the predicting slots [D, H]): (the D
    tokens, the distribution each was drawn from [D, V])."""
    head = drafter.markov_head
    base = hidden.to(lm_head.dtype) @ lm_head.t()
    prev = torch.tensor([anchor_token], device=hidden.device)
    state = torch.zeros(1, head.markov_w1.embedding_dim, dtype=hidden.dtype, device=hidden.device)
    tokens, dists = [], []
    for k in range(base.shape[0]):
        emb = head.markov_w1(prev)
        latent, state = head.step(state, emb.to(hidden.dtype), hidden[k : k + 1])
        logits = base[k].float() + head.markov_w2(latent.to(head.markov_w2.weight.dtype))[0].float()
        q = torch.softmax(logits / temperature, dim=-1)
        tok = int(torch.multinomial(q.cpu(), 1, generator=generator))
        tokens.append(tok)
        dists.append(q)
        prev = torch.tensor([tok], device=hidden.device)
    return tokens, torch.stack(dists)


# ----------------------------------------------------------------------------- checkpoint config
def dspark_fields(cfg, dflash_config: dict) -> dict:
    """What a DSpark checkpoint's config.json says beyond a DFlash one: its class, and the heads'
    fields both where vLLM and SpecForge read them (dflash_config, as SpecForge's
    configs/qwen3-8b-dspark.json) and where DeepSpec's Qwen3DSparkModel reads them (the top level:
    it refuses a config without target_layer_ids, mask_token_id, num_anchors, markov_rank,
    markov_head_type, enable_confidence_head and confidence_head_with_markov there)."""
    heads = {
        "confidence_head_alpha": 1.0,
        "confidence_head_with_markov": True,
        "enable_confidence_head": True,
        "markov_head_type": cfg.markov_head_type,
        "markov_rank": cfg.markov_rank,
    }
    return {
        "architectures": ["DSparkDraftModel"],
        "auto_map": {"AutoModel": "modeling_dflash.DSparkDraftModel"},
        "dflash_config": {
            **dflash_config,
            "attention_mode": "gqa" if cfg.num_key_value_heads < cfg.num_attention_heads else "mha",
            **heads,
            "projector_type": "dspark",
        },
        **heads,
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        **({"num_anchors": cfg.num_anchors} if cfg.num_anchors else {}),
        # TensorRT-LLM's DSpark reader looks for the layout here
        "dspark_config": {"sample_from_anchor": cfg.block_layout.sample_from_anchor},
    }


# ----------------------------------------------------------------------------- the recipe's hooks
class DSparkOps:
    """What the step, the evaluator and the checkpoint ask the DSpark recipe."""

    @staticmethod
    def attach_heads(drafter: nn.Module, cfg) -> None:
        attach_heads(drafter, cfg.hidden_size, cfg.vocab_size, cfg.markov_rank, cfg.markov_head_type)

    @staticmethod
    def head_keys(markov_head_type: str) -> set[str]:
        return head_keys(markov_head_type)

    @staticmethod
    def row_loss(drafter, inputs: RowLossInputs):
        """(loss, terms [R, 3], hits [R], weights [N, D]) of the predicting rows of N blocks."""
        loss, terms, hits = dspark_loss(drafter, inputs)
        return loss, terms, hits, inputs.decayed

    @staticmethod
    def draft(drafter, lm_head, slots, anchor_token):
        return markov_draft(drafter, lm_head, slots, anchor_token)

    @staticmethod
    def sample(drafter, lm_head, slots, anchor_token, temperature, generator):
        return markov_sample(drafter, lm_head, slots, anchor_token, temperature, generator)

    @staticmethod
    def export_fields(cfg, dflash_config: dict) -> dict:
        return dspark_fields(cfg, dflash_config)


OPS = DSparkOps()
