"""Our exports read by speculators' own code (vllm-project/speculators 0.9.0, installed apart by
`make speculators`): its DFlash converter, with its validation, takes our DFlash checkpoint, and
its DSparkSpeculatorConfig takes our DSpark config.json with every DSpark field it declares
stated (a field we leave out it fills with its own default: for sample_from_anchor that default
is a guess of the block layout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflash_core.checkpoint import save_checkpoint
from dflash_core.config import DrafterConfig
from dflash_core.defaults import DEFAULT_TARGET_LAYER_IDS
from dflash_core.drafter import DFlashDrafter
from tests.helpers import REPO_ROOT

SPECULATORS = REPO_ROOT / ".speculators"
pytestmark = pytest.mark.skipif(
    not (SPECULATORS / ".installed").is_file(), reason="speculators is not installed (make speculators)"
)

READ = r"""
import json, sys
from speculators.convert.dflash.converter import DFlashConverter
from speculators.models.dflash import DFlashSpeculatorConfig
from speculators.models.dspark.config import DSparkSpeculatorConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

dflash_dir, dspark_dir, target, out = sys.argv[1:5]
DFlashConverter().convert(dflash_dir, out, base_model=target, validate=True)
converted = json.load(open(out + "/config.json"))

conf = json.load(open(dspark_dir + "/config.json"))
own = set(DSparkSpeculatorConfig.model_fields) - set(DFlashSpeculatorConfig.model_fields)
stated = {f: conf[f] for f in own if f in conf}
layer = {k: v for k, v in conf.items() if k not in ("architectures", "auto_map", "dflash_config")}
spec = DSparkSpeculatorConfig(
    transformer_layer_config=layer,
    draft_vocab_size=conf["vocab_size"],
    block_size=conf["block_size"],
    aux_hidden_state_layer_ids=conf["eagle_aux_hidden_state_layer_ids"],
    mask_token_id=conf["mask_token_id"],
    sample_from_anchor=conf["sample_from_anchor"],
    speculators_config=SpeculatorsConfig(
        algorithm="dspark",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=conf["num_speculative_tokens"])],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=target, architectures=["Qwen3ForCausalLM"]),
    ),
    **stated,
)
print(json.dumps({
    "converted_block_size": converted.get("block_size"),
    "converted_sample_from_anchor": converted.get("sample_from_anchor"),
    "missing": sorted(own - set(stated) - {"speculators_model_type", "architectures"}),
    "dspark": {f: getattr(spec, f) for f in sorted(own - {"architectures"})},
    "sample_from_anchor": spec.sample_from_anchor,
}))
"""


def _drafter_config(target_dir: Path, **kw) -> DrafterConfig:
    from transformers import AutoConfig

    return DrafterConfig.from_target_config(
        AutoConfig.from_pretrained(str(target_dir)),
        num_hidden_layers=1,
        block_size=kw.pop("block_size", 8),
        mask_token_id=3,
        target_layer_ids=list(DEFAULT_TARGET_LAYER_IDS),
        **kw,
    )


def _save(cfg: DrafterConfig, path: Path) -> Path:
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(0)
    return save_checkpoint(path, drafter)


def test_speculators_reads_our_dflash_and_dspark_exports(default_assets, tmp_path):
    dflash = _save(_drafter_config(default_assets.target), tmp_path / "dflash")
    dspark_cfg = replace(
        _drafter_config(default_assets.target, recipe="dspark", markov_rank=8, block_size=7), num_anchors=32
    )
    dspark = _save(dspark_cfg, tmp_path / "dspark")
    env = {**os.environ, "PYTHONPATH": f"{SPECULATORS}{os.pathsep}{REPO_ROOT}"}
    run = subprocess.run(
        [sys.executable, "-c", READ, str(dflash), str(dspark), str(default_assets.target), str(tmp_path / "conv")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["converted_block_size"] == 8
    assert got["missing"] == [], got  # every DSpark field of speculators is stated by us
    assert got["sample_from_anchor"] is True
    assert got["dspark"]["markov_rank"] == 8 and got["dspark"]["markov_head_type"] == "vanilla"
    assert got["dspark"]["enable_confidence_head"] is True and got["dspark"]["confidence_head_with_markov"] is True
    # the converted DFlash checkpoint loads in speculators' own model class, weights intact
    from safetensors.torch import load_file

    ours = load_file(str(dflash / "model.safetensors"))
    theirs = load_file(str(next((tmp_path / "conv").glob("*.safetensors"))))
    assert torch.equal(ours["fc.weight"], theirs["fc.weight"].to(ours["fc.weight"].dtype))
