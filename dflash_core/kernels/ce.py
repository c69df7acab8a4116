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
def _ce_rows_kernel(
    logits_ptr,
    labels_ptr,
    weights_ptr,
    loss_ptr,
    correct_ptr,
    vocab,
    row_stride,
    NEED_GRAD: tl.constexpr,
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

    # pass 2: d(loss)/d(logits) = (softmax - onehot) * weight, written over the logits
    if NEED_GRAD:
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            in_row = idx < vocab
            x = tl.load(row_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - (idx == label).to(tl.float32)) * weight
            tl.store(row_ptr + idx, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


def chunk_loss_and_grad(
    hidden, lm_head_weight, labels, w, need_grad: bool, *, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS
):
    """One chunk, as loss._chunk_loss_and_grad: (weighted CE sum, argmax hits, d(loss)/d(hidden)).
    The logits buffer is reused for the gradient. block_v / num_warps: launch settings
    (bench.ce_kernel sweeps them)."""
    logits = hidden @ lm_head_weight.t()  # [rows, vocab] in the compute dtype
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    hits = torch.empty(rows, dtype=torch.int8, device=logits.device)
    with triton_launch_device(logits.device):
        _ce_rows_kernel[(rows,)](
            logits,
            labels.contiguous(),
            w.float().contiguous(),
            losses,
            hits,
            vocab,
            logits.stride(0),
            NEED_GRAD=need_grad,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    loss, correct = losses.sum(), hits.bool()
    if not need_grad:
        return loss, correct, None
    return loss, correct, (logits @ lm_head_weight).to(hidden.dtype)
