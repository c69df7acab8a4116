"""Training-time forward of a block == inference-time forward given only the context before its
anchor (the guard against `<=` at the anchor, leaking neighbours and shifted labels)."""

import numpy as np
import torch

from dflash_core.config import ShapeConfig
from dflash_core.data.batches import make_micro_batch
from dflash_core.data.packing import pack_documents
from dflash_core.drafter import FrozenHead
from dflash_core.step.loss import reference_lm_head_loss
from dflash_core.step.micro_step import StepSettings, inference_block_forward, micro_step
from dflash_core.target import TargetModel
from tests.helpers import random_documents, random_drafter, tiny_drafter_config


def test_training_blocks_equal_inference_blocks(random_target_dir, tokenizer):
    block = 4
    target = TargetModel(random_target_dir, [1, 3], "cpu")
    vocab = target.config.vocab_size
    cfg = tiny_drafter_config(
        vocab_size=vocab,
        block_size=block,
        hidden=target.hidden_size,
        heads=4,
        kv_heads=2,
        mask_token_id=tokenizer.mask_token_id,
    )
    drafter = random_drafter(cfg, seed=3)
    head64 = FrozenHead(target.frozen_head().embed_weight.double(), target.frozen_head().lm_head_weight.double())

    rng = np.random.default_rng(7)
    docs = random_documents(rng, 5, min_len=10, max_len=24, vocab=vocab, p_loss=0.7)
    seq_len = 128
    shape = ShapeConfig(seq_len=seq_len, num_anchors=10, block_size=block)
    seqs = pack_documents(docs, seq_len, pad_token_id=tokenizer.pad_token_id)
    assert len(set(seqs[0].doc_ids.tolist()) - {-1}) >= 3, "several packed documents"
    mb = make_micro_batch(seqs[0], shape, rng, 0)
    feats = target.capture(mb.input_ids, mb.position_ids, mb.doc_ids).double()

    with torch.no_grad():
        res = micro_step(drafter, head64, mb, feats, StepSettings("dense", 2.0, 7))
        from dflash_core.step.attention import training_attention
        from dflash_core.step.micro_step import drafter_forward

        train_hidden = drafter_forward(
            drafter,
            head64,
            mb,
            feats,
            training_attention("dense", mb.doc_ids, mb.anchors, mb.anchor_valid, seq_len, block),
        ).view(-1, block, cfg.hidden_size)

    doc_start = {}
    for p, d in enumerate(mb.doc_ids.tolist()):
        doc_start.setdefault(d, p)
    checked = 0
    inf_hidden, inf_labels, inf_weights = [], [], []
    for j, (a, ok) in enumerate(zip(mb.anchors.tolist(), mb.anchor_valid.tolist())):
        if not ok:
            continue
        d = mb.doc_ids[a].item()
        s = doc_start[d]
        ids = torch.full((block,), tokenizer.mask_token_id)
        ids[0] = mb.input_ids[a]
        with torch.no_grad():
            h = inference_block_forward(drafter, head64, feats[s:a], ids, a - s)
        assert (h - train_hidden[j]).abs().max() < 1e-9, f"block {j} at anchor {a} differs"
        # Labels read straight from the document, not from our label code.
        doc_tokens = mb.input_ids[mb.doc_ids == d]
        doc_mask = mb.loss_mask[mb.doc_ids == d]
        for k in range(1, block):
            t = a - s + k
            inf_hidden.append(h[k])
            inf_labels.append(doc_tokens[t] if t < len(doc_tokens) else 0)
            inf_weights.append(float(np.exp(-(k - 1) / 2.0)) if t < len(doc_tokens) and doc_mask[t] else 0.0)
        checked += 1
    assert checked >= 5
    want = reference_lm_head_loss(
        torch.stack(inf_hidden),
        head64.lm_head_weight,
        torch.stack([torch.as_tensor(x) for x in inf_labels]),
        torch.tensor(inf_weights),
    )
    assert abs(res.loss.item() - want.item()) < 1e-6 * want.item(), (res.loss.item(), want.item())
    # The check has teeth: labels shifted by one, or a context that includes the anchor (`<=`),
    # move the numbers far beyond that tolerance.
    shifted = reference_lm_head_loss(
        torch.stack(inf_hidden),
        head64.lm_head_weight,
        torch.stack([torch.as_tensor(x) for x in inf_labels[1:] + inf_labels[:1]]),
        torch.tensor(inf_weights),
    )
    assert abs(shifted.item() - want.item()) > 1e-3
    j = int(mb.anchor_valid.nonzero()[0])
    a = mb.anchors[j].item()
    s = doc_start[mb.doc_ids[a].item()]
    ids = torch.full((block,), tokenizer.mask_token_id)
    ids[0] = mb.input_ids[a]
    with torch.no_grad():
        leaky = inference_block_forward(drafter, head64, feats[s : a + 1], ids, a - s)
    assert (leaky - train_hidden[j]).abs().max() > 1e-4


def test_target_packing_is_isolated(random_target_dir):
    target = TargetModel(random_target_dir, [0, 2, 4], "cpu")
    rng = np.random.default_rng(0)
    docs = random_documents(rng, 4, min_len=8, max_len=16, vocab=target.config.vocab_size)
    seq = pack_documents(docs, 80, pad_token_id=0)[0]
    packed = target.capture(
        torch.from_numpy(seq.input_ids), torch.from_numpy(seq.position_ids), torch.from_numpy(seq.doc_ids)
    )
    for d, doc in enumerate(docs):
        ids = torch.from_numpy(doc.input_ids)
        alone = target.capture(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
        rows = torch.from_numpy(seq.doc_ids == d)
        assert torch.allclose(packed[rows], alone, atol=1e-5), d
    # The captured layers are exactly HF's hidden_states[id + 1].
    ids = torch.from_numpy(docs[0].input_ids)
    with torch.no_grad():
        hs = target.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1][0] for i in (0, 2, 4)], dim=-1)
    got = target.capture(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
    assert torch.allclose(got, want, atol=1e-5)
