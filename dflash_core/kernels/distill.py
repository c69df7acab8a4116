"""One chunk of the distillation objective (step.objectives) as a Triton kernel (CUDA).

The chunk is `zd = hidden @ W^T` (cuBLAS) beside the teacher's logits zt (step.teacher), this kernel, then
`grad_hidden = grad @ W` (cuBLAS). Per row, with p_d = softmax(zd), p_t = softmax(zt):
  pass 1 reads both rows for their running max and sum of exponentials, the drafter's argmax
         and the online sum  A = sum exp(zt - m_t) (zt - zd),  so KL = A / s_t - lse_t + lse_d;
  pass 2 reads them again for TV = 1/2 sum |p_d - p_t| and sigma = sum sign(p_d - p_t) p_d
         (TV's gradient needs it);
  pass 3 writes d(ce_w ce + kl_w kl + tv_w tv)/d(zd)
         = ce_w (p_d - onehot) + kl_w (p_d - p_t) + tv_w / 2 * p_d (sign(p_d - p_t) - sigma)
         over the drafter's logits, in their dtype, or (the FP8 lm_head) times a scale into an
         FP8 buffer of the padded vocabulary's width (zeros in the padding columns).
Rows are not weighted here: the position weight enters through autograd (objectives.py).

The FP8 chunk (`chunk_terms_fp8`, an fp8.Fp8Head) takes the logits as a view without the
padding columns (the kernel takes row strides and reads the first `vocab` columns only), and
scales the gradient by a bound known before the pass, so nothing reads the logits to find one:
  |pd - onehot| <= 1 and |pd - pt| <= 1 (every value is a difference of two numbers in [0, 1]);
  |1/2 pd (sign - sigma)| <= pd <= 1, since sign is -1, 0 or 1 and |sigma| <= sum pd = 1;
so |grad| <= |ce_w| + |kl_w| + |tv_w| per value, and that sum maps to FP8's largest value.

Same function as objectives.chunk_terms_eager (fp32 math on the logits, first index on argmax
ties); tests compare them through Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device
from .ce import store_scaled_grad

BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _logit_blocks(d_ptr, t_ptr, idx, vocab):
    # the drafter's and the teacher's logits at idx in fp32, -inf past the vocabulary (exp gives 0)
    in_row = idx < vocab
    xd = tl.load(d_ptr + idx, mask=in_row, other=float("-inf")).to(tl.float32)
    xt = tl.load(t_ptr + idx, mask=in_row, other=float("-inf")).to(tl.float32)
    return in_row, xd, xt


@triton.jit
def _mixed_grad(d_ptr, t_ptr, idx, in_row, label, lse_d, lse_t, sigma, w_ce, w_kl, w_tv):
    # d(mix . terms)/d(zd) at idx in fp32 (past the vocabulary: a value the callers mask off)
    xd = tl.load(d_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
    xt = tl.load(t_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
    pd = tl.exp(xd - lse_d)
    pt = tl.exp(xt - lse_t)
    diff = pd - pt
    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    onehot = (idx == label).to(tl.float32)
    return w_ce * (pd - onehot) + w_kl * diff + w_tv * 0.5 * pd * (sign - sigma)


@triton.jit
def _distill_rows_kernel(
    zd_ptr,
    zt_ptr,
    labels_ptr,
    mix_ptr,
    terms_ptr,
    correct_ptr,
    vocab,
    zd_stride,
    zt_stride,
    grad_ptr,
    grad_stride,
    grad_cols,
    grad_scale_ptr,
    grad_limit,
    NEED_GRAD: tl.constexpr,
    SCALED_GRAD: tl.constexpr,
    KEEP_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    d_ptr = zd_ptr + row.to(tl.int64) * zd_stride
    t_ptr = zt_ptr + row.to(tl.int64) * zt_stride
    label = tl.load(labels_ptr + row)
    label_ok = (label >= 0) & (label < vocab)
    label = tl.where(label_ok, label, 0).to(tl.int32)
    cols = tl.arange(0, BLOCK_V)

    # pass 1: both rows' max and sum of exponentials, the drafter's argmax, and A (see above)
    m_d = tl.full([], float("-inf"), tl.float32)
    s_d = tl.zeros([], tl.float32)
    m_t = tl.full([], float("-inf"), tl.float32)
    s_t = tl.zeros([], tl.float32)
    acc = tl.zeros([], tl.float32)
    best = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        in_row, xd, xt = _logit_blocks(d_ptr, t_ptr, start + cols, vocab)
        block_max, block_best = tl.max(xd, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(block_max > m_d, start + block_best, best)
        new_d = tl.maximum(m_d, block_max)
        s_d = s_d * tl.exp(m_d - new_d) + tl.sum(tl.exp(xd - new_d), axis=0)
        m_d = new_d
        new_t = tl.maximum(m_t, tl.max(xt, axis=0))
        et = tl.exp(xt - new_t)
        scale = tl.exp(m_t - new_t)
        s_t = s_t * scale + tl.sum(et, axis=0)
        acc = acc * scale + tl.sum(tl.where(in_row, et * (xt - xd), 0.0), axis=0)
        m_t = new_t
    lse_d = m_d + tl.log(s_d)
    lse_t = m_t + tl.log(s_t)
    target = tl.where(label_ok, tl.load(d_ptr + label).to(tl.float32), float("nan"))
    ce = lse_d - target
    kl = acc / s_t - lse_t + lse_d

    # pass 2: TV and sigma
    tv2 = tl.zeros([], tl.float32)
    sigma = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        _, xd, xt = _logit_blocks(d_ptr, t_ptr, start + cols, vocab)
        pd = tl.exp(xd - lse_d)
        diff = pd - tl.exp(xt - lse_t)
        sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        tv2 += tl.sum(tl.abs(diff), axis=0)
        sigma += tl.sum(sign * pd, axis=0)
    tl.store(terms_ptr + row * 3 + 0, ce)
    tl.store(terms_ptr + row * 3 + 1, kl)
    tl.store(terms_ptr + row * 3 + 2, 0.5 * tv2)
    tl.store(correct_ptr + row, (best == label).to(tl.int8))

    # pass 3: the mixed gradient over the drafter's logits, or (SCALED_GRAD) times a scale and
    # clamped to +-grad_limit into grad_ptr's low-precision row of grad_cols values, zeros past
    # the vocabulary (KEEP_GRAD: over the drafter's logits as well, unscaled)
    if NEED_GRAD:
        w_ce = tl.load(mix_ptr + 0)
        w_kl = tl.load(mix_ptr + 1)
        w_tv = tl.load(mix_ptr + 2)
        if SCALED_GRAD:
            g_scale = tl.load(grad_scale_ptr)
            g_row = grad_ptr + row.to(tl.int64) * grad_stride
            for start in range(0, grad_cols, BLOCK_V):
                idx = start + cols
                in_row = idx < vocab
                grad = _mixed_grad(d_ptr, t_ptr, idx, in_row, label, lse_d, lse_t, sigma, w_ce, w_kl, w_tv)
                if KEEP_GRAD:
                    tl.store(d_ptr + idx, grad.to(zd_ptr.dtype.element_ty), mask=in_row)
                store_scaled_grad(g_row, idx, grad * g_scale, in_row, grad_cols, grad_limit)
        else:
            for start in range(0, vocab, BLOCK_V):
                idx = start + cols
                in_row = idx < vocab
                grad = _mixed_grad(d_ptr, t_ptr, idx, in_row, label, lse_d, lse_t, sigma, w_ce, w_kl, w_tv)
                tl.store(d_ptr + idx, grad.to(zd_ptr.dtype.element_ty), mask=in_row)


def _launch_rows(zd, zt, labels, mix, need_grad, grad, grad_scale, limit, keep_grad, block_v, num_warps):
    """_distill_rows_kernel over a chunk's logits: (terms [rows, 3], argmax hits); with need_grad
    the mixed gradient goes over zd, or where grad_scale (a one-value tensor) is given, times it
    and clamped to +-limit into `grad` (and over zd too with keep_grad)."""
    rows, vocab = zd.shape
    terms = torch.empty(rows, 3, dtype=torch.float32, device=zd.device)
    hits = torch.empty(rows, dtype=torch.int8, device=zd.device)
    with triton_launch_device(zd.device):
        _distill_rows_kernel[(rows,)](
            zd,
            zt,
            labels.contiguous(),
            mix,
            terms,
            hits,
            vocab,
            zd.stride(0),
            zt.stride(0),
            grad,
            grad.stride(0),
            grad.shape[1],
            terms if grad_scale is None else grad_scale,  # unread without a scale
            limit,
            NEED_GRAD=need_grad,
            SCALED_GRAD=grad_scale is not None,
            KEEP_GRAD=keep_grad,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return terms, hits.bool()


def logit_terms(zd, zt, labels, mix, need_grad: bool, *, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS):
    """On given logits [rows, vocab] (drafter's, teacher's): (terms [rows, 3], argmax hits, the
    mixed gradient written over zd (returned), or None)."""
    mix = mix.float().contiguous()
    terms, hits = _launch_rows(zd, zt, labels, mix, need_grad, zd, None, 0.0, False, block_v, num_warps)
    return terms, hits, (zd if need_grad else None)


def logit_terms_fp8(
    zd,
    zt,
    labels,
    mix,
    need_grad: bool,
    padded: int,
    keep_grad: bool = False,
    *,
    block_v: int = BLOCK_V,
    num_warps: int = NUM_WARPS,
):
    """logit_terms with the gradient for an FP8 lm_head's GEMM (padded: its vocabulary's padded
    width): (terms, hits, the gradient in fp8.GRAD_DTYPE [rows, padded] or None, the inverse of
    its scale; keep_grad: the unscaled gradient written over zd as well, for GEMMs that stay in
    zd's dtype). The scale maps the bound of the module docstring to the format's largest value."""
    from ..fp8 import GRAD_DTYPE

    mix = mix.float().contiguous()
    limit = torch.finfo(GRAD_DTYPE).max
    bound = mix.abs().sum().clamp(min=1e-12)
    grad8 = torch.empty(zd.shape[0], padded, dtype=GRAD_DTYPE, device=zd.device) if need_grad else zd
    terms, hits = _launch_rows(
        zd, zt, labels, mix, need_grad, grad8, limit / bound, limit, keep_grad, block_v, num_warps
    )
    return terms, hits, (grad8 if need_grad else None), bound / limit


def chunk_terms(hidden, zt, lm_head_weight, labels, mix, need_grad: bool, **launch):
    """As objectives.chunk_terms_eager (zt: the rows' teacher logits): (terms [rows, 3], argmax
    hits, unweighted row gradient)."""
    zd = hidden @ lm_head_weight.t()
    terms, hits, grad = logit_terms(zd, zt, labels, mix, need_grad, **launch)
    if grad is None:
        return terms, hits, None
    return terms, hits, (grad @ lm_head_weight).to(hidden.dtype)


def chunk_terms_fp8(hidden, zt, head, labels, mix, need_grad: bool, **launch):
    """chunk_terms with the lm_head GEMMs in FP8 (head: fp8.Fp8Head, quantized once; zt the
    rows' teacher logits, [rows, head.vocab]): the chunk's hidden states cast to e4m3 with one
    scale, the logits gradient written by the kernel straight into FP8."""
    from ..fp8 import FORWARD_DTYPE, head_grad, head_logits, quantize

    zd = head_logits(*quantize(hidden, FORWARD_DTYPE), head)
    terms, hits, grad8, grad_inv = logit_terms_fp8(zd, zt, labels, mix, need_grad, head.rows.shape[0], **launch)
    if grad8 is None:
        return terms, hits, None
    return terms, hits, head_grad(grad8, grad_inv, head).to(hidden.dtype)
