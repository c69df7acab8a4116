"""Speculative sampling (dflash_core/evaluate_sampled.py): the rejection rule leaves the target's
distribution (drawn many times on explicit distributions), and at a near-zero temperature the
sampled decoding is the greedy one, for a DFlash and a DSpark drafter."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_core.evaluate_sampled import speculative_sample, verify_token


def test_rejection_rule_keeps_the_target_distribution():
    p = torch.tensor([0.5, 0.1, 0.05, 0.3, 0.05])
    q = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1])
    g = torch.Generator().manual_seed(0)
    n = 20000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    counts = torch.zeros(5)
    accepted = 0
    for x in drafts:
        ok, token = verify_token(p, q, x, g)
        counts[token] += 1
        accepted += ok
    assert float((counts / n - p).abs().max()) < 0.015, counts / n
    # the acceptance probability is sum min(p, q)
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.015


@pytest.mark.parametrize("recipe", ["dflash", "dspark"])
def test_near_zero_temperature_is_greedy(default_assets, recipe):
    from transformers import AutoTokenizer

    from dflash_core.config import DrafterConfig
    from dflash_core.data.conversations import read_conversations
    from dflash_core.defaults import DEFAULT_TARGET_LAYER_IDS
    from dflash_core.drafter import DFlashDrafter
    from dflash_core.evaluate import greedy_generate, prompt_ids, stop_ids
    from dflash_core.target import TargetModel

    target = TargetModel(default_assets.target, list(DEFAULT_TARGET_LAYER_IDS), "cpu")
    tok = AutoTokenizer.from_pretrained(str(default_assets.target))
    cfg = DrafterConfig.from_target_config(
        target.config,
        num_hidden_layers=1,
        block_size=5,
        mask_token_id=3,
        target_layer_ids=list(DEFAULT_TARGET_LAYER_IDS),
    )
    if recipe == "dspark":
        cfg = replace(cfg, recipe="dspark", markov_rank=8, markov_head_type="rnn")
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(0)
    head = target.frozen_head()
    stops = stop_ids(tok)
    g = torch.Generator().manual_seed(0)
    for conv in list(read_conversations(default_assets.heldout))[:2]:
        prompt = prompt_ids(tok, conv.messages)
        spec = speculative_sample(
            target, drafter, head, prompt, temperature=1e-4, max_new_tokens=16, stop_token_ids=stops, generator=g
        )
        assert spec.tokens == greedy_generate(target, prompt, max_new_tokens=16, stop_token_ids=stops)
        assert all(1 <= n <= 5 for n in spec.acceptance_lengths)
