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
    assert conf["dflash_config"] == {
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "input_embedding_scale": 1.0,
        "sample_from_anchor": False,
    }
    # the layout, stated where each runtime reads it (a DFlash drafter is fill_in by default)
    assert conf["sample_from_anchor"] is False and conf["dspark_bonus_anchor"] is True
    assert conf["num_speculative_tokens"] == cfg.block_size - 1
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


class _Planted:
    """A pickle payload that would create a file when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_in_the_training_state_is_refused(tmp_path):
    """Resume loads training_state.pt with weights_only: a pickle that would run code is refused
    with a readable error and nothing of it runs."""
    import pytest
    import torch

    from dflash_core.checkpoint import TRAINING_STATE_FILE, UnsafeTrainingState, load_training_state

    marker = tmp_path / "pwned"
    ckpt = tmp_path / "step-00000010"
    ckpt.mkdir()
    torch.save({"step": 10, "payload": _Planted(marker)}, ckpt / TRAINING_STATE_FILE)
    with pytest.raises(UnsafeTrainingState, match="objects other than tensors"):
        load_training_state(ckpt)
    assert not marker.exists()
    torch.save({"step": 10, "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}}, ckpt / TRAINING_STATE_FILE)
    assert load_training_state(ckpt)["step"] == 10  # what the trainer writes still loads
