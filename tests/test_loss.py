"""Labels, weights and the chunked LM-head loss against hand-computed values and a dense reference."""

import math

import numpy as np
import pytest
import torch

from dflash_core.config import ShapeConfig
from dflash_core.data.batches import MicroBatch
from dflash_core.drafter import FrozenHead
from dflash_core.step.attention import training_attention
from dflash_core.step.blocks import block_inputs, block_labels, expected_acceptance_length, position_decay
from dflash_core.step.loss import (
    _chunk_loss_and_grad,
    _chunk_loss_and_grad_fusible,
    chunked_lm_head_loss,
    reference_lm_head_loss,
)
from dflash_core.step.micro_step import StepSettings, drafter_forward, micro_step
from tests.helpers import random_drafter, random_micro_batch, tiny_drafter_config


def hand_batch():
    # Two documents: doc 0 = tokens 10..15 (assistant from position 2), doc 1 = tokens 20..23.
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 0, 0])
    doc = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1])
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0])
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0], dtype=torch.bool)
    anchors = torch.tensor([3, 7, 0])
    valid = torch.tensor([True, True, False])
    return MicroBatch(ids, pos, doc, mask, anchors, valid)


def test_block_inputs_and_labels_by_hand():
    mb = hand_batch()
    ids, positions = block_inputs(mb, block_size=4, mask_token_id=99)
    assert ids.view(3, 4).tolist() == [[13, 99, 99, 99], [21, 99, 99, 99], [10, 99, 99, 99]]
    assert positions.view(3, 4).tolist() == [[3, 4, 5, 6], [1, 2, 3, 4], [0, 1, 2, 3]]
    labels, weights = block_labels(mb, block_size=4, gamma=2.0)
    labels, weights = labels.view(3, 4), weights.view(3, 4)
    # anchor 3 predicts 14, 15, then position 6 belongs to doc 1 -> weight 0
    assert labels[0, 1:3].tolist() == [14, 15]
    assert torch.allclose(weights[0], torch.tensor([0.0, 1.0, math.exp(-0.5), 0.0]))
    # anchor 7 predicts 22, 23, then padding -> weight 0
    assert labels[1, 1:3].tolist() == [22, 23]
    assert torch.allclose(weights[1], torch.tensor([0.0, 1.0, math.exp(-0.5), 0.0]))
    assert weights[2].tolist() == [0.0] * 4  # padding block
    # the position weights given as a tensor (a recorded step keeps them in a buffer of its own)
    # are the ones gamma gives, and they, not gamma, decide
    given = block_labels(mb, block_size=4, gamma=0.1, decay=position_decay(4, 2.0))
    assert torch.equal(given[0].view(3, 4), labels) and torch.equal(given[1].view(3, 4), weights)


def test_known_loss_value():
    # Vocab 3, hidden 2; lm_head = identity-like so logits are easy to write down.
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    hidden = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    labels = torch.tensor([0, 2, 1])
    weights = torch.tensor([1.0, 0.5, 0.0])
    # logits row0 = [2,0,0] -> CE(label 0) = log(e^2+2) - 2 ; row1 = [0,1,0] -> CE(label 2) = log(2+e) - 0
    ce0 = math.log(math.exp(2) + 2) - 2
    ce1 = math.log(2 + math.e)
    want = (1.0 * ce0 + 0.5 * ce1) / 1.5
    loss, correct = chunked_lm_head_loss(hidden, w, labels, weights, chunk_size=2)
    assert abs(loss.item() - want) < 1e-6
    assert correct.tolist() == [True, False, False]


def _chunked_and_reference(seed, rows, vocab, dtype, scale, kernel="eager"):
    """(loss, correct, gradient) of the chunked loss and (loss, gradient) of the dense reference,
    both backpropagated with `scale`, on one random problem."""
    torch.manual_seed(seed)
    hidden = torch.randn(rows, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, 16, dtype=dtype)
    labels = torch.randint(0, vocab, (rows,))
    weights = torch.rand(rows, dtype=dtype) * (torch.rand(rows) > 0.3)
    loss, correct = chunked_lm_head_loss(hidden, w, labels, weights, chunk_size=8, kernel=kernel)
    (scale * loss).backward()
    got = hidden.grad.clone()
    hidden.grad = None
    ref = reference_lm_head_loss(hidden, w, labels, weights)
    (scale * ref).backward()
    argmax_hits = (hidden.detach() @ w.t()).argmax(-1) == labels
    return (loss, correct, got), (ref, hidden.grad, argmax_hits)


def test_chunked_loss_and_gradient_match_dense_reference():
    (loss, _, got), (ref, ref_grad, _) = _chunked_and_reference(0, 37, 50, torch.float64, 2.0)
    assert abs(loss.item() - ref.item()) < 1e-6
    assert torch.allclose(got, ref_grad, atol=1e-6)


def test_decay_and_expected_acceptance():
    d = position_decay(16, 7.0)
    assert d[0] == 0 and d[1] == 1 and abs(d[8].item() - math.exp(-1)) < 1e-6
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 3.0
    assert abs(expected_acceptance_length([1.0, 0.5, 0.5]) - (1 + 0.5 + 0.25)) < 1e-12


def test_fusible_chunk_gradient_equals_the_in_place_one():
    """The compiled path's pure-expression gradient is the eager path's in-place one."""
    torch.manual_seed(1)
    hidden = torch.randn(24, 16)
    w = torch.randn(300, 16)
    labels = torch.randint(0, 300, (24,))
    labels[3] = labels[4] = 299  # repeated and last-column labels
    labels[5] = 0
    weights = torch.rand(24) * (torch.rand(24) > 0.3)
    weights = weights / weights.sum()
    eager = _chunk_loss_and_grad(hidden, w, labels, weights, True)
    pure = _chunk_loss_and_grad_fusible(hidden, w, labels, weights, True)
    assert torch.allclose(eager[0], pure[0], atol=1e-6)
    assert torch.equal(eager[1], pure[1])
    assert torch.allclose(eager[2], pure[2], atol=1e-6)
    assert pure[2].abs().sum() > 0


def test_compiled_chunked_loss_matches_dense_reference():
    (loss, correct, got), (ref, ref_grad, argmax_hits) = _chunked_and_reference(
        2, 40, 64, torch.float32, 3.0, kernel="compiled"
    )
    assert abs(loss.item() - ref.item()) < 1e-5
    assert torch.allclose(got, ref_grad.float(), atol=1e-5)
    assert torch.equal(correct, argmax_hits)


def test_micro_step_skips_position_zero_without_changing_loss_or_gradients():
    """micro_step computes no logits for position 0 of a block (its weight is always 0): the loss
    and every parameter gradient equal the loss over all positions."""
    rng = np.random.default_rng(4)
    cfg = tiny_drafter_config(block_size=4)
    shape = ShapeConfig(seq_len=48, num_anchors=6, block_size=4)
    mb = random_micro_batch(rng, shape, n_docs=2)
    drafter = random_drafter(cfg)
    g = torch.Generator().manual_seed(0)
    head = FrozenHead(
        torch.randn(64, cfg.hidden_size, dtype=torch.float64, generator=g),
        torch.randn(64, cfg.hidden_size, dtype=torch.float64, generator=g),
    )
    feats = torch.randn(48, 2 * cfg.hidden_size, dtype=torch.float64, generator=g)
    res = micro_step(drafter, head, mb, feats, StepSettings("dense", 2.0, 5))
    res.loss.backward()
    got = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    attend = training_attention("dense", mb.doc_ids, mb.anchors, mb.anchor_valid, 48, 4)
    hidden = drafter_forward(drafter, head, mb, feats, attend)
    labels, weights = block_labels(mb, 4, 2.0)
    assert weights.view(6, 4)[:, 0].eq(0).all() and weights.sum() > 0
    ref = reference_lm_head_loss(hidden, head.lm_head_weight, labels, weights)
    ref.backward()
    assert abs(res.loss.item() - ref.item()) < 1e-5
    for name, p in drafter.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-5), name
    argmax_hits = ((hidden.detach() @ head.lm_head_weight.t()).argmax(-1) == labels).view(6, 4)
    assert not res.correct[:, 0].any()
    assert torch.equal(res.correct[:, 1:], argmax_hits[:, 1:])


@pytest.mark.slow  # the Triton kernel in the (slow) interpreter
@pytest.mark.interpreted_check("tests.ce_check")
def test_triton_chunk_matches_eager_chunk_interpreted(interpreted):
    """The Triton CE kernel of kernels/ce.py (Triton's interpreter on CPU; tests/gpu runs it on
    CUDA in bf16): same loss, gradient and argmax hits as the eager chunk, ties broken to the
    first index, one and several vocabulary blocks; and a whole micro-step with it equals the
    eager one."""
    result = interpreted("tests.ce_check")
    assert result.pop("bad_label_nan")
    step = result.pop("micro_step")  # the whole micro-step, chunks of 5 rows, through the autograd Function
    assert step["loss_rel"] < 1e-6 and step["grad_rel_max"] < 1e-5 and step["hits_equal"], step
    for case, diff in result.items():
        assert diff["loss_rel"] < 1e-6 and diff["grad_rel"] < 1e-6, (case, diff)
        assert diff["hit_mismatches"] == 0 and diff["tie_rows_first_index"] and diff["loss_only_same"], (case, diff)
        assert diff["hits"] > 0, (case, diff)  # right answers to compare
    assert result["several_blocks"]["argmax_blocks"] >= 2  # argmaxes past the first vocabulary block


def test_unknown_loss_kernel_is_refused():
    with pytest.raises(ValueError, match="loss kernel"):
        chunked_lm_head_loss(
            torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), torch.ones(4), 2, kernel="fast"
        )
