"""One loss chunk's cross-entropy and its logits gradient as a two-pass Triton kernel (CUDA).

The chunk is `logits = hidden @ W^T` (cuBLAS), this kernel, then `grad_hidden = grad @ W`
(cuBLAS). Per row, pass 1 reads the logits once for the running max, the sum of exponentials and
the argmax; pass 2 reads them again and writes (softmax - onehot) * weight over them, in place,
in the logits' dtype. That is two reads and one write of the [rows, vocab] logits, the least a
softmax gradient needs when a row (151936 values) does not fit on chip; inductor's fused kernel
for the same math reads the logits more often. It also means no compiled graph for the loss: one
graph less per drafter GPU to compile on a cold start. `python -m bench.ce_kernel` times one chunk
against the compiled form (docs/performance.md).

Same function as loss._chunk_loss_and_grad (fp32 math on the logits, first index on argmax
ties); tests compare them through Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device

BLOCK_V = 4096  # the fastest of bench.ce_kernel's sweep on an H200 (2048 and 8192 are slower)
NUM_WARPS = 8


@triton.jit
def store_scaled_grad(g_row, idx, grad, in_row, grad_cols, grad_limit):
    """grad (already times its scale) clamped to +-grad_limit into a low-precision gradient row
    of grad_cols values, zeros past the vocabulary (the padding columns of an FP8 lm_head)."""
    grad = tl.where(in_row, tl.minimum(tl.maximum(grad, -grad_limit), grad_limit), 0.0)
    tl.store(g_row + idx, grad.to(g_row.dtype.element_ty), mask=idx < grad_cols)


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    labels_ptr,
    weights_ptr,
    loss_ptr,
    correct_ptr,
    vocab,
    row_stride,
    grad_ptr,
    grad_stride,
    grad_cols,
    grad_scale_ptr,
    grad_limit,
    NEED_GRAD: tl.constexpr,
    SCALED_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    label = tl.load(labels_ptr + row)
    label_ok = (label >= 0) & (label < vocab)
    label = tl.where(label_ok, label, 0).to(tl.int32)
    weight = tl.load(weights_ptr + row)
    cols = tl.arange(0, BLOCK_V)

    # pass 1: online max and sum of exp(x - max); argmax as the first index of the maximum
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    best_index = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        # the block's maximum and the first index of it; a later block wins only when strictly larger
        block_max, block_best = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best_index = tl.where(block_max > running_max, start + block_best, best_index)
        new_max = tl.maximum(running_max, block_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    # a label outside the vocabulary (never made by the data pipeline) gives a NaN loss, not a
    # read past the row
    target = tl.where(label_ok, tl.load(row_ptr + label).to(tl.float32), float("nan"))
    tl.store(loss_ptr + row, (lse - target) * weight)
    tl.store(correct_ptr + row, (best_index == label).to(tl.int8))

    # pass 2: d(loss)/d(logits) = (softmax - onehot) * weight, written over the logits, or
    # (SCALED_GRAD) times a scale into grad_ptr's low-precision row of grad_cols values (zeros past
    # the vocabulary: the padding columns of an FP8 lm_head)
    if NEED_GRAD:
        if SCALED_GRAD:
            scale = tl.load(grad_scale_ptr)
            g_row = grad_ptr + row.to(tl.int64) * grad_stride
            for start in range(0, grad_cols, BLOCK_V):
                idx = start + cols
                in_row = idx < vocab
                x = tl.load(row_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
                grad = (tl.exp(x - lse) - (idx == label).to(tl.float32)) * (weight * scale)
                store_scaled_grad(g_row, idx, grad, in_row, grad_cols, grad_limit)
        else:
            for start in range(0, vocab, BLOCK_V):
                idx = start + cols
                in_row = idx < vocab
                x = tl.load(row_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
                grad = (tl.exp(x - lse) - (idx == label).to(tl.float32)) * weight
                tl.store(row_ptr + idx, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


def _launch_rows(logits, labels, w, vocab, grad, grad_scale, limit, need_grad, block_v, num_warps):
    """_ce_rows_kernel over a chunk's logits (the first `vocab` columns are the vocabulary): (loss
    sum, argmax hits); with need_grad the logits gradient goes to `grad`, times grad_scale (a
    one-value tensor) and clamped to +-limit where grad_scale is given."""
    rows = logits.shape[0]
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    hits = torch.empty(rows, dtype=torch.int8, device=logits.device)
    with triton_launch_device(logits.device):
        _ce_rows_kernel[(rows,)](
            logits,
            labels.contiguous(),
            w,
            losses,
            hits,
            vocab,
            logits.stride(0),
            grad,
            grad.stride(0),
            grad.shape[1],
            losses if grad_scale is None else grad_scale,  # unread without a scale
            limit,
            NEED_GRAD=need_grad,
            SCALED_GRAD=grad_scale is not None,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return losses.sum(), hits.bool()


def chunk_loss_and_grad(
    hidden, lm_head_weight, labels, w, need_grad: bool, *, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS
):
    """One chunk, as loss._chunk_loss_and_grad: (weighted CE sum, argmax hits, d(loss)/d(hidden)).
    The logits buffer is reused for the gradient. block_v / num_warps: launch settings
    (bench.ce_kernel sweeps them)."""
    logits = hidden @ lm_head_weight.t()  # [rows, vocab] in the compute dtype
    loss, correct = _launch_rows(
        logits, labels, w.float().contiguous(), logits.shape[1], logits, None, 0.0, need_grad, block_v, num_warps
    )
    if not need_grad:
        return loss, correct, None
    return loss, correct, (logits @ lm_head_weight).to(hidden.dtype)


def chunk_loss_and_grad_fp8(
    hidden, head, labels, w, need_grad: bool, *, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS
):
    """chunk_loss_and_grad with the lm_head GEMMs in FP8 (head: fp8.Fp8Head, quantized once):
    the chunk's hidden states cast to e4m3 with one scale, the logits gradient written by the
    kernel straight into FP8. Its scale needs no pass over the logits: |(softmax - onehot) * w|
    <= w, so the rows' largest weight bounds it."""
    from ..fp8 import FORWARD_DTYPE, GRAD_DTYPE, quantize, scaled_mm

    h8, h_inv = quantize(hidden, FORWARD_DTYPE)
    logits = scaled_mm(h8, h_inv, head.rows.t(), head.inv_scale, torch.bfloat16)  # [rows, padded vocab]
    w = w.float().contiguous()
    grad8 = torch.empty_like(logits, dtype=GRAD_DTYPE) if need_grad else logits
    limit = torch.finfo(GRAD_DTYPE).max
    grad_scale = limit / w.abs().amax().clamp(min=1e-12)
    loss, correct = _launch_rows(logits, labels, w, head.vocab, grad8, grad_scale, limit, need_grad, block_v, num_warps)
    if not need_grad:
        return loss, correct, None
    grad = scaled_mm(grad8, grad_scale.reciprocal(), head.cols.t(), head.inv_scale, torch.bfloat16)
    return loss, correct, grad.to(hidden.dtype)
