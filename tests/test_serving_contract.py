"""The serving contract of docs/design.md, checked against a checkpoint the engine wrote: every
config field a loader (z-lab reference, SGLang, vLLM) reads is there, the fields left to their
defaults are absent, the weights are exactly the listed keys; "auto" exports in the target's
dtype; the checkpoint names its target by identity, never by a host path; `eval` takes the
target from --target or the daemon's config and says whether it is the recorded one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_core.target_identity import config_sha256, hub_id, resolve_export_dtype, target_identity
from tests.test_targets import _common

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"
STEPS = 2


def contract_table(name: str) -> list[list[str]]:
    """Rows (cells, without the header) of the table between <!-- serving-contract:NAME --> and
    its closing marker."""
    text = DESIGN.read_text()
    m = re.search(rf"<!-- serving-contract:{name} -->\n(.*?)\n<!-- /serving-contract:{name} -->", text, re.S)
    assert m, f"docs/design.md has no serving-contract:{name} table"
    lines = [ln for ln in m.group(1).splitlines() if ln.startswith("|")][2:]  # header and rule
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines]
    assert rows and all(len(r) == len(rows[0]) for r in rows)
    return rows


def field_name(cell: str) -> str:
    m = re.fullmatch(r"`([^`]+)`", cell)
    assert m, f"first column must be one `field`: {cell!r}"
    return m.group(1)


def stored_dtypes(path: Path) -> dict[str, torch.dtype]:
    """Key -> dtype of a safetensors file."""
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
        return {k: f.get_tensor(k).dtype for k in names}


def lookup(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory, default_assets):
    """A tiny Qwen3 target saved in bf16, in a Hugging Face cache snapshot's layout."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(default_assets.target))
    torch.manual_seed(0)
    cfg = Qwen3Config(**_common(tok))
    out = tmp_path_factory.mktemp("hub") / "models--acme--tiny-qwen3" / "snapshots" / "0a1b2c"
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def export(bf16_target, default_assets, tmp_path_factory):
    """(checkpoint directory, engine drafter config) of a short job with the default export_dtype."""
    from dflash_core.engine import Engine, EngineConfig, TrainJob

    cfg = EngineConfig(
        target_path=bf16_target,
        drafter_devices=["cpu"],
        seq_len=128,
        num_anchors=8,
        block_size=8,
        drafter_layers=2,
        target_layer_ids=[1, 2],
    )
    engine = Engine(cfg, default_assets.root.parent.parent).build()
    out = tmp_path_factory.mktemp("contract")
    try:
        job = TrainJob(
            datasets=[str(default_assets.train)], output_dir=str(out), steps=STEPS, checkpoint_interval=STEPS
        )
        assert job.export_dtype == "auto"
        res = engine.run_job(job)
        assert res.status == "SUCCEEDED"
        return Path(res.final_checkpoint), engine.drafter_config
    finally:
        engine.close()


def test_every_field_a_loader_reads_is_written(export, bf16_target):
    path, cfg = export
    config = json.loads((path / "config.json").read_text())
    rows = contract_table("config")
    missing = []
    for row in rows:
        name = field_name(row[0])
        assert any(c not in ("", "-") for c in row[1:4]), f"{name}: no loader reads it"
        try:
            lookup(config, name)
        except KeyError:
            missing.append(name)
    assert not missing, f"config.json lacks fields the loaders read: {missing}"
    # the values the loaders' semantics depend on
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["layer_types"] == ["full_attention"] * cfg.num_hidden_layers and config["is_causal"] is False
    ids = config["dflash_config"]["target_layer_ids"]
    assert ids == [1, 2] and config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]
    assert config["num_target_layers"] == 4 and config["block_size"] == 8
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] and config["rope_scaling"] is None
    assert config["dflash_config"]["input_embedding_scale"] == 1.0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bf16_target))
    mask = config["dflash_config"]
    assert tok.convert_tokens_to_ids(mask["mask_token"]) == mask["mask_token_id"] == cfg.mask_token_id
    assert config["torch_dtype"] == "bfloat16"


def test_fields_left_to_their_defaults_are_absent(export):
    path, _ = export
    config = json.loads((path / "config.json").read_text())
    for row in contract_table("defaults"):
        name = field_name(row[0])
        with pytest.raises(KeyError):
            lookup(config, name)


def test_the_weights_are_exactly_the_listed_keys(export):
    path, cfg = export
    patterns = [field_name(row[0]) for row in contract_table("weights")]
    want = {p.format(i=i) for p in patterns for i in range(cfg.num_hidden_layers)}
    exported = stored_dtypes(path / "model.safetensors")
    assert set(exported) == want
    assert set(exported.values()) == {torch.bfloat16}  # "auto": the target's declared dtype
    masters = stored_dtypes(path / "training_state" / "master_weights.safetensors")
    assert set(masters) == want and set(masters.values()) == {torch.float32}


def test_the_target_is_recorded_by_identity_not_by_path(export, bf16_target, tmp_path):
    path, _ = export
    meta = json.loads((path / "dflash_metadata.json").read_text())
    config = json.loads((bf16_target / "config.json").read_text())
    assert meta["target"] == {"name": "acme/tiny-qwen3", "config_sha256": config_sha256(config), "dtype": "bf16"}
    host = str(bf16_target.parents[3])  # the temporary directories of this host
    for f in path.iterdir():
        if f.is_file():
            assert host.encode() not in f.read_bytes(), f"{f.name} records a host path"


def test_identity_and_auto_dtype_rules(tmp_path):
    plain = tmp_path / "my-target"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"dtype": "float16", "_name_or_path": "Org/Model-7B"}))
    assert target_identity(plain)["name"] == "Org/Model-7B" and target_identity(plain)["dtype"] == "fp16"
    (plain / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "_name_or_path": str(plain)}))
    assert target_identity(plain) == {
        "name": None,
        "config_sha256": config_sha256({"torch_dtype": "bfloat16"}),
        "dtype": "bf16",
    }
    assert hub_id(tmp_path / "models--a--b" / "snapshots" / "c") == "a/b"
    assert [resolve_export_dtype(d, "bf16") for d in ("auto", "fp32", "bf16")] == ["bf16", "fp32", "bf16"]
    assert resolve_export_dtype("auto", None) == "fp32"
    with pytest.raises(ValueError, match="export_dtype"):
        resolve_export_dtype("fp8", None)


def test_export_auto_takes_the_recorded_dtype(export, tmp_path):
    from dflash_core.checkpoint import export_checkpoint

    path, _ = export
    out = export_checkpoint(path, tmp_path / "served")  # the CLI's default: auto
    assert set(stored_dtypes(out / "model.safetensors").values()) == {torch.bfloat16}
    fp32 = export_checkpoint(path, tmp_path / "served32", "fp32")
    assert set(stored_dtypes(fp32 / "model.safetensors").values()) == {torch.float32}


def test_eval_takes_the_target_from_the_daemon_config(export, bf16_target, default_assets, tmp_path, capsys):
    from service.cli import main

    path, _ = export
    daemon = tmp_path / "daemon.yaml"
    daemon.write_text(f"data_dir: {tmp_path / 'data'}\nengine:\n  target_path: {bf16_target}\n")
    args = ["eval", "--checkpoint", str(path), "--prompts", str(default_assets.heldout), "--max-prompts", "1"]
    args += ["--max-new-tokens", "4", "--data-dir", str(default_assets.root.parent.parent), "--json"]
    assert main([*args, "--config", str(daemon)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["target"] == str(bf16_target) and summary["target_matches"] is True
    other = tmp_path / "other"  # the same shapes, another config: evaluated, and said so
    shutil.copytree(bf16_target, other)
    conf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**conf, "rms_norm_eps": 1e-5}))
    assert main([*args, "--target", str(other)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["target"] == str(other) and summary["target_matches"] is False
    assert main([*args, "--target", str(default_assets.target)]) == 2
    assert "does not fit the drafter" in capsys.readouterr().err
    assert main([*args, "--target", str(tmp_path)]) == 2
    assert "not a model directory" in capsys.readouterr().err
