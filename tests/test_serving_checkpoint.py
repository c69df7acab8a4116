"""Checkpoints are ready to serve: transformers' AutoModel loads one with trust_remote_code (the
reference's documented path) and computes what our drafter computes; files are readable by other
users; the training state sits in its own subdirectory; `export` writes a serving directory from
any checkpoint."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_core.checkpoint import load_training_state, load_weights, save_checkpoint
from dflash_core.step.attention import DenseAttention
from tests.helpers import random_drafter, tiny_drafter_config

REPO = Path(__file__).resolve().parents[1]


def our_hidden(drafter, noise, feats, ctx_len, q_len, anchor):
    block_pos = torch.arange(anchor, anchor + q_len)
    with torch.no_grad():
        return drafter(noise, feats, block_pos, torch.arange(ctx_len), DenseAttention(None))


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}])
def test_automodel_trust_remote_code_computes_our_drafter(tmp_path, monkeypatch, rope):
    from transformers import AutoModel

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))  # where transformers copies remote code
    cfg = tiny_drafter_config(layers=2)
    if rope is not None:
        from dataclasses import replace

        cfg = replace(cfg, rope_scaling=rope, max_position_embeddings=1024)
    drafter = random_drafter(cfg, seed=3).float()
    path = save_checkpoint(tmp_path / "step-00000010", drafter, training_state={"step": 10})
    model = AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == "DFlashDraftModel"
    torch.manual_seed(1)
    ctx_len, q_len, anchor = 12, cfg.block_size, 12
    noise = torch.randn(1, q_len, cfg.hidden_size)
    feats = torch.randn(1, ctx_len, cfg.num_target_features * cfg.hidden_size)
    positions = torch.cat([torch.arange(ctx_len), torch.arange(anchor, anchor + q_len)]).unsqueeze(0)
    with torch.no_grad():
        theirs = model(noise_embedding=noise, target_hidden=feats, position_ids=positions)
    ours = our_hidden(drafter, noise, feats, ctx_len, q_len, anchor)
    assert (theirs - ours).abs().max() <= 1e-5 * max(1.0, ours.abs().max())


def test_layout_modes_and_bf16_export_with_fp32_masters_for_resume(tmp_path):
    cfg = tiny_drafter_config(layers=2)
    drafter = random_drafter(cfg, seed=5).float()
    from dflash_core.checkpoint import write_checkpoint

    weights = {k: v.detach() for k, v in drafter.state_dict().items()}
    path = write_checkpoint(tmp_path / "step-00000004", cfg, weights, training_state={"step": 4}, export_dtype="bf16")
    names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))
    assert names == sorted(
        [
            "config.json",
            "model.safetensors",
            "modeling_dflash.py",
            "training_state",
            "training_state/master_weights.safetensors",
            "training_state/training_state.pt",
        ]
    )
    conf = json.loads((path / "config.json").read_text())
    assert conf["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"} and conf["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(path / "model.safetensors")).values())
    masters = load_weights(path, 2, masters=True)  # what resume continues from: exact fp32
    assert all(torch.equal(masters[k], weights[k]) for k in weights)
    assert load_training_state(path) == {"step": 4}
    for p in [path, *path.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))


@pytest.mark.slow  # the export command in a fresh interpreter
def test_export_command_writes_a_serving_directory(tmp_path):
    cfg = tiny_drafter_config(layers=2)
    drafter = random_drafter(cfg, seed=7).float()
    src = save_checkpoint(tmp_path / "step-00000002", drafter, training_state={"step": 2})
    # an older layout: training state at the top level, no modeling file, no auto_map
    os.replace(src / "training_state" / "training_state.pt", src / "training_state.pt")
    (src / "training_state").rmdir()
    (src / "modeling_dflash.py").unlink()
    conf = json.loads((src / "config.json").read_text())
    del conf["auto_map"]
    (src / "config.json").write_text(json.dumps(conf))
    out = tmp_path / "served"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "export", str(src), str(out), "--dtype", "bf16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    assert json.loads((out / "config.json").read_text())["auto_map"]
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(v, drafter.state_dict()[k].to(torch.bfloat16)) for k, v in exported.items())
    again = subprocess.run(
        [sys.executable, "-m", "service.cli", "export", str(src), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 1 and "exists" in again.stderr
