"""Block layouts as the recipe's property: labels and weights against DeepSpec's rule, the
public DSpark recipe's numbers, and the layout stated in and read from config.json."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from dflash_core.checkpoint import hf_config, read_config, save_checkpoint
from dflash_core.config import ShapeConfig
from dflash_core.drafter import DFlashDrafter
from dflash_core.engine.admission import check_resume
from dflash_core.engine.api import JobError
from dflash_core.engine.config import EngineConfig
from dflash_core.recipes import ANCHOR_FIRST, FILL_IN, RECIPES, Recipe, RecipeTable, recipe_named
from dflash_core.step.blocks import block_labels, position_decay
from dflash_core.step.objective_spec import objective_of, parse_loss
from tests.helpers import random_drafter, random_micro_batch, tiny_drafter_config


def deepspec_labels(batch, block_size: int, gamma: float):
    """DeepSpec (afdfa7c9) `deepspec/modeling/dspark/qwen3/modeling.py`: label_offsets =
    arange(1, B + 1); `common.build_eval_mask`: in range, loss-masked, kept block, then cumprod
    over the block; `loss._build_loss_weight_mask`: times exp(-k / gamma) for k = 0..B-1. Its
    sequences are not packed, so a label in another document is out of its sequence: the
    same-document test stands in for its `label_indices < seq_len`."""
    seq_len = batch.input_ids.shape[0]
    idx = batch.anchors.unsqueeze(1) + torch.arange(1, block_size + 1)
    safe = idx.clamp(max=seq_len - 1)
    in_seq = (idx < seq_len) & (batch.doc_ids[safe] == batch.doc_ids[batch.anchors].unsqueeze(1))
    mask = in_seq & batch.loss_mask[safe] & batch.anchor_valid.unsqueeze(1)
    mask = mask.int().cumprod(dim=-1).bool()
    decay = torch.exp(-torch.arange(block_size).float() / gamma)
    return batch.input_ids[safe], mask * decay


@pytest.mark.parametrize("seed", range(4))
def test_anchor_first_labels_and_weights_are_deepspecs(seed):
    shape = ShapeConfig(seq_len=96, num_anchors=12, block_size=7)
    batch = random_micro_batch(np.random.default_rng(seed), shape)
    labels, weights = block_labels(batch, 7, 4.0, layout=ANCHOR_FIRST)
    want_labels, want_weights = deepspec_labels(batch, 7, 4.0)
    counted = want_weights.reshape(-1) > 0
    assert torch.equal(labels[counted], want_labels.reshape(-1)[counted])
    assert torch.allclose(weights, want_weights.reshape(-1))
    assert counted.any()


def test_fill_in_is_the_dflash_rule():
    shape = ShapeConfig(seq_len=64, num_anchors=8, block_size=5)
    batch = random_micro_batch(np.random.default_rng(3), shape)
    labels, weights = block_labels(batch, 5, 2.0, layout=FILL_IN)
    w = weights.view(8, 5)
    assert torch.equal(w[:, 0], torch.zeros(8))  # the anchor's own slot predicts nothing
    assert torch.equal(labels.view(8, 5)[:, 1], batch.input_ids[(batch.anchors + 1).clamp(max=63)])
    assert torch.allclose(position_decay(5, 2.0, layout=FILL_IN)[1:], torch.exp(-torch.arange(4.0) / 2.0))


def test_the_public_dspark_recipe():
    dspark = recipe_named("dspark")
    assert dspark.layout is ANCHOR_FIRST and dspark.block_size == 7 and dspark.gamma == 4.0
    objective = objective_of(parse_loss(dict(dspark.loss or {})), "decay", 0.5)
    # DeepSpec's l1_loss_alpha 0.9 on sum |p_d - p_t| is 1.8 on TV = 1/2 sum |p_d - p_t|
    assert (objective.ce, objective.tv, objective.conf) == (0.1, 1.8, 1.0)
    engine = EngineConfig(recipe="dspark")
    assert engine.block_size == 7 and engine.teacher and engine.draft_length == 7
    assert EngineConfig(recipe="dspark", layout="fill_in").draft_length == 6
    assert EngineConfig().block_layout is FILL_IN and EngineConfig(layout="anchor_first").draft_length == 8


def test_a_recipe_name_registers_once():
    with pytest.raises(ValueError, match="twice"):
        RecipeTable(*[recipe_named(n) for n in RECIPES.names()], replace(recipe_named("dflash")))
    assert isinstance(RECIPES["dflash"], Recipe)
    with pytest.raises(ValueError, match="recipe must be one of"):
        RECIPES["eagle"]


@pytest.mark.parametrize("layout", ["fill_in", "anchor_first"])
def test_the_layout_is_stated_and_read_back(tmp_path, layout):
    cfg = replace(tiny_drafter_config(block_size=6), layout=layout)
    path = save_checkpoint(tmp_path / "ckpt", DFlashDrafter(cfg))
    conf = json.loads((path / "config.json").read_text())
    anchor_first = layout == "anchor_first"
    assert conf["sample_from_anchor"] is anchor_first and conf["dflash_config"]["sample_from_anchor"] is anchor_first
    assert conf["dspark_bonus_anchor"] is (not anchor_first)
    assert conf["num_speculative_tokens"] == (6 if anchor_first else 5)
    assert read_config(path).layout == layout


def test_a_config_without_the_layout_reads_as_the_fill_in_it_was_written_in(tmp_path):
    cfg = replace(tiny_drafter_config(), recipe="dspark", markov_rank=4, layout="anchor_first")
    conf = hf_config(cfg, torch.float32)
    for key in ("sample_from_anchor", "dspark_bonus_anchor", "block_layout", "num_speculative_tokens"):
        conf.pop(key)
    conf["dflash_config"].pop("sample_from_anchor")
    (tmp_path / "config.json").write_text(json.dumps(conf))
    assert read_config(tmp_path).layout == "fill_in"
    conf["sample_from_anchor"] = "yes"
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="sample_from_anchor"):
        read_config(tmp_path)


def test_a_resume_of_another_layout_is_refused(tmp_path):
    """An engine restarted with another layout (or block size) does not resume a job's checkpoint
    onto labels of the other layout: the job fails naming output_dir and both values."""
    cfg = tiny_drafter_config()
    path = save_checkpoint(tmp_path / "step-10", random_drafter(cfg, seed=1).float(), training_state={"step": 10})
    check_resume(str(path), cfg)  # the same drafter: resumes
    other = replace(cfg, layout="anchor_first")
    with pytest.raises(JobError, match=r"cannot resume.*layout 'fill_in' \(the engine's 'anchor_first'\)") as e:
        check_resume(str(path), other)
    assert e.value.field == "output_dir"
