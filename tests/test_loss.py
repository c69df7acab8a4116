"""Labels, weights and the chunked LM-head loss against hand-computed values and a dense reference."""
import math

import torch

from dflash_core.blocks import block_inputs, block_labels, expected_acceptance_length, position_decay
from dflash_core.data.batches import MicroBatch
from dflash_core.loss import chunked_lm_head_loss, reference_lm_head_loss


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


def test_chunked_loss_and_gradient_match_dense_reference():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,))
    weights = torch.rand(37, dtype=torch.float64) * (torch.rand(37) > 0.3)
    loss, _ = chunked_lm_head_loss(hidden, w, labels, weights, chunk_size=8)
    (2.0 * loss).backward()
    got = hidden.grad.clone()
    hidden.grad = None
    ref = reference_lm_head_loss(hidden, w, labels, weights)
    (2.0 * ref).backward()
    assert abs(loss.item() - ref.item()) < 1e-6
    assert torch.allclose(got, hidden.grad, atol=1e-6)


def test_decay_and_expected_acceptance():
    d = position_decay(16, 7.0)
    assert d[0] == 0 and d[1] == 1 and abs(d[8].item() - math.exp(-1)) < 1e-6
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 3.0
    assert abs(expected_acceptance_length([1.0, 0.5, 0.5]) - (1 + 0.5 + 0.25)) < 1e-12
