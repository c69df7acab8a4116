"""One chunk of the distillation objective (step.objectives) as a Triton kernel (CUDA).

The chunk is `zd = hidden @ W^T` (cuBLAS) beside the teacher's logits zt (step.teacher), this kernel, then
`grad_hidden = grad @ W` (cuBLAS). The teacher's rows come as step.teacher.TeacherRows: a table
the kernel indexes per row (no gathered copy) and each teacher row's logsumexp lse_t, formed
once per table by `row_logsumexp` (one pass over the table, not one per row that reads it). Per
row, with p_d = softmax(zd), p_t = softmax(zt) = exp(zt - lse_t):
  pass 1 reads the drafter's row for its max, sum of exponentials and argmax (lse_d, ce);
  pass 2 reads both rows for KL = sum p_t (zt - zd) + lse_d - lse_t, TV = 1/2 sum |p_d - p_t|
         and sigma = sum sign(p_d - p_t) p_d (TV's gradient needs it);
  pass 3 writes d(ce_w ce + kl_w kl + tv_w tv)/d(zd)
         = ce_w (p_d - onehot) + kl_w (p_d - p_t) + tv_w / 2 * p_d (sign(p_d - p_t) - sigma)
         over the drafter's logits, in their dtype, or (the FP8 lm_head) times a scale into an
         FP8 buffer of the padded vocabulary's width (zeros in the padding columns).
Where the mix does not weight TV (tv_w = 0, a runtime test: one compiled kernel serves every
mix) the gradient needs no sigma, so pass 3 sums KL and TV as it goes and pass 2 is skipped: the
chunk then reads the drafter's logits twice and the teacher's once, a CE chunk's traffic plus one
read of the teacher's row.
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
from ..step.teacher import TeacherRows
from .ce import store_scaled_grad

BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _row_lse_kernel(z_ptr, out_ptr, vocab, stride, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    ptr = z_ptr + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        x = tl.load(ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new) + tl.sum(tl.exp(x - new), axis=0)
        m = new
    tl.store(out_ptr + row, m + tl.log(s))


def row_logsumexp(z: torch.Tensor, *, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """logsumexp of each row of z [N, V] (rows with a stride, e.g. a view without padding
    columns) in fp32 math: [N] fp32."""
    rows, vocab = z.shape
    out = torch.empty(rows, dtype=torch.float32, device=z.device)
    if z.stride(1) != 1:
        z = z.contiguous()
    with triton_launch_device(z.device):
        _row_lse_kernel[(rows,)](z, out, vocab, z.stride(0), BLOCK_V=block_v, num_warps=num_warps)
    return out


@triton.jit
def _both_blocks(d_ptr, t_ptr, idx, in_row, lse_d, lse_t):
    # the drafter's and the teacher's logits and probabilities at idx (zeros past the vocabulary)
    xd = tl.load(d_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
    xt = tl.load(t_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
    pd = tl.where(in_row, tl.exp(xd - lse_d), 0.0)
    pt = tl.where(in_row, tl.exp(xt - lse_t), 0.0)
    return xd, xt, pd, pt


@triton.jit
def _mixed_grad(pd, pt, idx, label, sigma, w_ce, w_kl, w_tv):
    # d(mix . terms)/d(zd) in fp32 from both rows' probabilities, and sign(pd - pt)
    diff = pd - pt
    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    onehot = (idx == label).to(tl.float32)
    return w_ce * (pd - onehot) + w_kl * diff + w_tv * 0.5 * pd * (sign - sigma)


@triton.jit
def _grad_pass(
    d_ptr,
    t_ptr,
    g_row,
    vocab,
    grad_cols,
    label,
    lse_d,
    lse_t,
    sigma,
    w_ce,
    w_kl,
    w_tv,
    g_scale,
    grad_limit,
    SCALED_GRAD: tl.constexpr,
    KEEP_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # pass 3 (see the module docstring); returns sum p_t (zt - zd) and sum |p_d - p_t| as it goes
    cols = tl.arange(0, BLOCK_V)
    kl_part = tl.zeros([], tl.float32)
    tv2 = tl.zeros([], tl.float32)
    width = grad_cols if SCALED_GRAD else vocab
    for start in range(0, width, BLOCK_V):
        idx = start + cols
        in_row = idx < vocab
        xd, xt, pd, pt = _both_blocks(d_ptr, t_ptr, idx, in_row, lse_d, lse_t)
        kl_part += tl.sum(pt * (xt - xd), axis=0)
        tv2 += tl.sum(tl.abs(pd - pt), axis=0)
        grad = _mixed_grad(pd, pt, idx, label, sigma, w_ce, w_kl, w_tv)
        if SCALED_GRAD:
            if KEEP_GRAD:
                tl.store(d_ptr + idx, grad.to(d_ptr.dtype.element_ty), mask=in_row)
            store_scaled_grad(g_row, idx, grad * g_scale, in_row, grad_cols, grad_limit)
        else:
            tl.store(d_ptr + idx, grad.to(d_ptr.dtype.element_ty), mask=in_row)
    return kl_part, tv2


@triton.jit
def _distill_rows_kernel(
    zd_ptr,
    zt_ptr,
    t_index_ptr,
    lse_t_ptr,
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
    HAS_INDEX: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    SCALED_GRAD: tl.constexpr,
    KEEP_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    t_row = tl.load(t_index_ptr + row).to(tl.int64) if HAS_INDEX else row.to(tl.int64)
    d_ptr = zd_ptr + row.to(tl.int64) * zd_stride
    t_ptr = zt_ptr + t_row * zt_stride
    lse_t = tl.load(lse_t_ptr + t_row)
    label = tl.load(labels_ptr + row)
    label_ok = (label >= 0) & (label < vocab)
    label = tl.where(label_ok, label, 0).to(tl.int32)
    cols = tl.arange(0, BLOCK_V)
    w_ce = tl.load(mix_ptr + 0)
    w_kl = tl.load(mix_ptr + 1)
    w_tv = tl.load(mix_ptr + 2)

    # pass 1: the drafter's max, sum of exponentials and argmax
    m_d = tl.full([], float("-inf"), tl.float32)
    s_d = tl.zeros([], tl.float32)
    best = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        xd = tl.load(d_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        block_max, block_best = tl.max(xd, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(block_max > m_d, start + block_best, best)
        new_d = tl.maximum(m_d, block_max)
        s_d = s_d * tl.exp(m_d - new_d) + tl.sum(tl.exp(xd - new_d), axis=0)
        m_d = new_d
    lse_d = m_d + tl.log(s_d)
    target = tl.where(label_ok, tl.load(d_ptr + label).to(tl.float32), float("nan"))

    # pass 2 (where the gradient needs sigma, or there is no gradient): KL, TV and sigma
    # (without a gradient: always, whatever w_tv holds; a tensor in both cases, as tl.where takes)
    two_pass = (w_tv != 0.0) if NEED_GRAD else ((w_tv != 0.0) | (w_tv == 0.0))
    kl_part = tl.zeros([], tl.float32)
    tv2 = tl.zeros([], tl.float32)
    sigma = tl.zeros([], tl.float32)
    if two_pass:
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            xd, xt, pd, pt = _both_blocks(d_ptr, t_ptr, idx, idx < vocab, lse_d, lse_t)
            diff = pd - pt
            kl_part += tl.sum(pt * (xt - xd), axis=0)
            tv2 += tl.sum(tl.abs(diff), axis=0)
            sigma += tl.sum(tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0)) * pd, axis=0)

    # pass 3: the mixed gradient over the drafter's logits, or (SCALED_GRAD) times a scale and
    # clamped to +-grad_limit into grad_ptr's low-precision row of grad_cols values, zeros past
    # the vocabulary (KEEP_GRAD: over the drafter's logits as well, unscaled)
    if NEED_GRAD:
        g_scale = tl.load(grad_scale_ptr) if SCALED_GRAD else 1.0
        g_row = grad_ptr + row.to(tl.int64) * grad_stride
        kl_g, tv_g = _grad_pass(
            d_ptr,
            t_ptr,
            g_row,
            vocab,
            grad_cols,
            label,
            lse_d,
            lse_t,
            sigma,
            w_ce,
            w_kl,
            w_tv,
            g_scale,
            grad_limit,
            SCALED_GRAD,
            KEEP_GRAD,
            BLOCK_V,
        )
        kl_part = tl.where(two_pass, kl_part, kl_g)
        tv2 = tl.where(two_pass, tv2, tv_g)
    tl.store(terms_ptr + row * 3 + 0, lse_d - target)
    tl.store(terms_ptr + row * 3 + 1, kl_part + lse_d - lse_t)
    tl.store(terms_ptr + row * 3 + 2, 0.5 * tv2)
    tl.store(correct_ptr + row, (best == label).to(tl.int8))


def _teacher_rows(zt: torch.Tensor | TeacherRows, block_v: int, num_warps: int) -> TeacherRows:
    """The chunk's teacher as TeacherRows, its logsumexp formed where it was not (over every
    row of `logits`: callers that index a table pass the table's lse, formed once)."""
    rows = zt if isinstance(zt, TeacherRows) else TeacherRows(zt)
    if rows.lse is not None:
        return rows
    return TeacherRows(rows.logits, rows.index, row_logsumexp(rows.logits, block_v=block_v, num_warps=num_warps))


def _launch_rows(zd, zt, labels, mix, need_grad, grad, grad_scale, limit, keep_grad, block_v, num_warps):
    """_distill_rows_kernel over a chunk's logits (zt: its teacher, logits [rows, vocab] or
    TeacherRows): (terms [rows, 3], argmax hits); with need_grad the mixed gradient goes over
    zd, or where grad_scale (a one-value tensor) is given, times it and clamped to +-limit into
    `grad` (and over zd too with keep_grad)."""
    rows, vocab = zd.shape
    teacher = _teacher_rows(zt, block_v, num_warps)
    zt_logits = teacher.logits
    if zt_logits.stride(1) != 1:
        zt_logits = zt_logits.contiguous()
    terms = torch.empty(rows, 3, dtype=torch.float32, device=zd.device)
    hits = torch.empty(rows, dtype=torch.int8, device=zd.device)
    with triton_launch_device(zd.device):
        _distill_rows_kernel[(rows,)](
            zd,
            zt_logits,
            terms if teacher.index is None else teacher.index.contiguous(),  # unread without an index
            teacher.lse.contiguous(),
            labels.contiguous(),
            mix,
            terms,
            hits,
            vocab,
            zd.stride(0),
            zt_logits.stride(0),
            grad,
            grad.stride(0),
            grad.shape[1],
            terms if grad_scale is None else grad_scale,  # unread without a scale
            limit,
            HAS_INDEX=teacher.index is not None,
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
