"""Checkpoint round trip in the DFlashDraftModel format; atomic writes."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_core.checkpoint import expected_keys, load_drafter, load_training_state, save_checkpoint
from dflash_core.step.attention import DenseAttention
from tests.helpers import random_drafter, tiny_drafter_config

FORMAT_KEYS_LAYER = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def test_round_trip_and_exact_key_set(tmp_path):
    cfg = tiny_drafter_config(layers=3)
    drafter = random_drafter(cfg, seed=5).float()
    path = save_checkpoint(tmp_path / "step-10", drafter, training_state={"step": 10}, metadata={"step": 10})
    keys = set(load_file(str(path / "model.safetensors")))
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(3) for k in FORMAT_KEYS_LAYER
    }
    assert keys == want == expected_keys(3)
    conf = json.loads((path / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["block_size"] == cfg.block_size and conf["num_target_layers"] == cfg.num_target_layers
    assert conf["dflash_config"] == {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    assert conf["num_hidden_layers"] == 3 and len(conf["layer_types"]) == 3

    loaded = load_drafter(path)
    assert loaded.config == cfg
    torch.manual_seed(0)
    x = torch.randn(1, 8, cfg.hidden_size)
    feats = torch.randn(1, 5, 2 * cfg.hidden_size)
    args = (torch.arange(5, 13), torch.arange(5), DenseAttention(None))
    with torch.no_grad():
        assert torch.equal(drafter(x, feats, *args), loaded(x, feats, *args))
    assert load_training_state(path) == {"step": 10}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failed_save_leaves_no_torn_checkpoint(tmp_path):
    cfg = tiny_drafter_config()
    drafter = random_drafter(cfg).float()
    good = save_checkpoint(tmp_path / "ckpt", drafter)
    before = (good / "model.safetensors").read_bytes()

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path / "ckpt", drafter, training_state={"x": Unpicklable()})
    assert (good / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
