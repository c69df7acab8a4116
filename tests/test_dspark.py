"""The DSpark recipe (dflash_core/recipes/dspark.py): its loss against a dense float64 reference
(values and every head's gradient), the engine settings it implies, the checkpoint against the
public format (SpecForge a6b6b023: `specforge/modeling/draft/dspark.py` parameter names and
`configs/qwen3-8b-dspark.json` fields; SpecForge itself is not installable in CI, so its key
list and fields are written out here), and an engine that trains a DSpark drafter, decodes
losslessly with the Markov bias and reports the confidence head's calibration."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from dflash_core.checkpoint import config_from_hf, hf_config, save_checkpoint
from dflash_core.drafter import DFlashDrafter
from dflash_core.recipes.dspark import calibrate, dspark_loss, reference_dspark_loss
from dflash_core.step.inputs import RowLossInputs
from dflash_core.step.objectives import ObjectiveInputs
from tests.helpers import assets_job, build_engine, random_drafter, small_engine_config, tiny_drafter_config

# SpecForge a6b6b023, configs/qwen3-8b-dspark.json: the DSpark fields of dflash_config
PUBLIC_DFLASH_CONFIG_KEYS = {
    "attention_mode",
    "confidence_head_alpha",
    "confidence_head_with_markov",
    "enable_confidence_head",
    "markov_head_type",
    "markov_rank",
    "mask_token_id",
    "projector_type",
    "target_layer_ids",
}
# SpecForge a6b6b023, specforge/modeling/draft/dspark.py: DSparkDraftModel's head parameters
# (VanillaMarkovHead.markov_w1 / markov_w2, AcceptRatePredictor.proj) beside the DFlash backbone's
PUBLIC_HEAD_KEYS = {
    "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight",
    "confidence_head.proj.weight",
    "confidence_head.proj.bias",
}
# GatedMarkovHead.gate_proj and RNNMarkovHead.joint_proj (nn.Linear with bias)
PUBLIC_EXTRA_KEYS = {
    "vanilla": set(),
    "gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
    "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"},
}


def dspark_config(rank=8, kind="vanilla", **kw):
    return replace(tiny_drafter_config(**kw), recipe="dspark", markov_rank=rank, markov_head_type=kind)


def latents_by_definition(drafter, emb, hidden, kind, k):
    """The Markov latents from the public heads' definitions (SpecForge a6b6b023 dspark.py:
    VanillaMarkovHead, GatedMarkovHead.compute_gate, RNNMarkovHead._rnn_step), row by row."""
    head = drafter.markov_head
    if kind == "vanilla":
        return emb
    if kind == "gated":
        return torch.sigmoid(torch.cat([hidden, emb], -1) @ head.gate_proj.weight.t() + head.gate_proj.bias) * emb
    out = []
    for n in range(emb.shape[0] // k):
        state = torch.zeros_like(emb[0])
        for j in range(k):
            i = n * k + j
            z = torch.cat([state, emb[i], hidden[i]]) @ head.joint_proj.weight.t() + head.joint_proj.bias
            r = emb.shape[1]
            gate, cand, o = torch.sigmoid(z[:r]), torch.tanh(z[r : 2 * r]), z[2 * r :]
            out.append(torch.tanh(o))
            state = gate * state + (1 - gate) * cand
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_loss_matches_the_dense_reference(kind):
    cfg = dspark_config(block_size=4, kind=kind)
    drafter = random_drafter(cfg, seed=1).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a Markov bias and a confidence head that are not at their init
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5, generator=g)
    rows, hidden = 15, cfg.hidden_size
    h = torch.randn(rows, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(64, hidden, generator=g, dtype=torch.float64) * 0.3
    prev, labels = torch.randint(0, 64, (rows,), generator=g), torch.randint(0, 64, (rows,), generator=g)
    weights = torch.rand(rows, generator=g, dtype=torch.float64)
    weights[4] = 0
    mix, conf = torch.tensor([0.1, 0.2, 0.9], dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    params = [h, *(p for n, p in drafter.named_parameters() if "head" in n)]
    objective = ObjectiveInputs("cpu")
    objective.mix, objective.conf = mix, conf
    # 5 blocks of 3 predicting positions
    inputs = RowLossInputs(
        h, ht, w, prev.view(5, 3), labels, weights.view(5, 3), objective, chunk_size=4, kernel="eager"
    )
    loss, terms, _ = dspark_loss(drafter, inputs)
    got = torch.autograd.grad(loss, params)
    emb = drafter.markov_head.markov_w1(prev)
    ref = reference_dspark_loss(drafter, inputs, latents_by_definition(drafter, emb, h, kind, 3))
    want = torch.autograd.grad(ref, params)
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-6 * max(1.0, abs(float(ref.detach())))
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) <= 1e-6 * max(1e-6, float(b.abs().max()))
    assert bool((terms[:, 2] <= 1 + 1e-6).all())


@pytest.mark.slow  # the Triton kernel in the (slow) interpreter
@pytest.mark.interpreted_check("tests.distill_check", "--fp8-dspark")
def test_dspark_loss_with_the_fp8_lm_head_interpreted(interpreted):
    """The Markov objective with the FP8 lm_head ("triton_fp8": the lm_head's logits and grad_h
    by FP8 GEMMs, the Markov bias and its gradients in bf16; Triton's interpreter, chunks of 16
    rows, a vocabulary FP8 pads) and with the bf16 one, each against the dense float64
    reference, a teacher near the drafter. The loss within the FP8 CE chunk's 0.5 %
    (tests/test_fp8.py); the gradients within 20 %: the mix is mostly tv, whose gradient is a sign
    of p_d - p_t that any rounding flips where the two nearly agree (the bf16 path is several
    percent off already), and kl's p_d - p_t shrinks as they agree while FP8's rounding does not.
    A gradient that lost the row weights or the lm_head's part would be off by far more."""
    result = interpreted("tests.distill_check", "--fp8-dspark")
    fp8, bf16 = result["fp8"], result["bf16"]
    assert fp8["loss_rel"] < 5e-3 and bf16["loss_rel"] < 1e-3, result
    assert set(fp8["grad_rel"]) == {"rows", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    assert max(fp8["grad_rel"].values()) < 0.2 and max(bf16["grad_rel"].values()) < 0.1, result


def test_engine_settings_of_the_dspark_recipe():
    from pydantic import ValidationError

    from dflash_core.engine.config import EngineConfig

    cfg = EngineConfig(recipe="dspark")
    assert cfg.block_size == 7 and cfg.teacher
    assert EngineConfig(recipe="dspark", block_size=7).block_size == 7
    with pytest.raises(ValidationError, match="block_size"):
        EngineConfig(recipe="dspark", block_size=8)
    with pytest.raises(ValidationError, match="markov_rank"):
        EngineConfig(markov_rank=16)
    with pytest.raises(ValidationError, match="markov_rank"):
        EngineConfig(recipe="dspark", markov_rank=0)
    with pytest.raises(ValidationError, match="markov_head_type"):
        EngineConfig(markov_head_type="rnn")
    assert EngineConfig(recipe="dspark", markov_head_type="rnn").markov_head_type == "rnn"
    assert EngineConfig().block_size == 8 and not EngineConfig().teacher  # defaults unchanged


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_checkpoint_has_the_public_dspark_format(tmp_path, kind):
    cfg = dspark_config(rank=8, kind=kind)
    drafter = DFlashDrafter(cfg)
    heads = {n for n, _ in drafter.named_parameters() if "head" in n}
    assert heads == PUBLIC_HEAD_KEYS | PUBLIC_EXTRA_KEYS[kind]
    d = hf_config(cfg, torch.bfloat16)
    assert d["architectures"] == ["DSparkDraftModel"]
    # the public DSpark fields, and beside them only what the DFlash serving contract adds
    assert set(d["dflash_config"]) >= PUBLIC_DFLASH_CONFIG_KEYS
    assert set(d["dflash_config"]) - PUBLIC_DFLASH_CONFIG_KEYS <= {
        "input_embedding_scale",
        "mask_token",
        "sample_from_anchor",
    }
    assert d["dflash_config"]["projector_type"] == "dspark" and d["dflash_config"]["markov_head_type"] == kind
    assert d["dflash_config"]["markov_rank"] == 8 and d["block_size"] == cfg.block_size
    assert config_from_hf(d) == cfg
    from safetensors.torch import load_file

    path = save_checkpoint(tmp_path / "ck", drafter)
    keys = set(load_file(str(path / "model.safetensors")))
    assert keys >= PUBLIC_HEAD_KEYS and not any(k.startswith(("embed", "lm_head")) for k in keys)
    written = json.loads((path / "config.json").read_text())
    assert written["auto_map"]["AutoModel"].endswith(".DSparkDraftModel")
    # the shipped modeling file's class loads it with no missing or unexpected keys
    from transformers import AutoModel

    model, info = AutoModel.from_pretrained(str(path), trust_remote_code=True, output_loading_info=True)
    assert type(model).__name__ == "DSparkDraftModel"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, p in drafter.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name


def test_calibration_fits_held_out_outcomes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, generator=g) * 2
    outcome = (torch.rand(2000, generator=g) < torch.sigmoid(0.5 * logits - 1.0)).double()
    cal = calibrate(logits, outcome)
    assert abs(cal["scale"] - 0.5) < 0.15 and abs(cal["bias"] + 1.0) < 0.2, cal
    assert cal["ece_after"] < cal["ece_before"]


@pytest.mark.slow
def test_engine_trains_a_dspark_drafter_that_decodes_losslessly(default_assets, tmp_path):
    from dflash_core.checkpoint import load_drafter, read_metadata
    from dflash_core.data.conversations import read_conversations
    from dflash_core.evaluate import evaluate_acceptance

    engine = build_engine(small_engine_config(recipe="dspark"), default_assets)
    try:
        assert engine.drafter_config.recipe == "dspark" and engine.drafter_config.block_size == 7
        res = engine.run_job(assets_job(default_assets, tmp_path, 8, eval_prompts=2, eval_new_tokens=16))
        assert res.status == "SUCCEEDED", res
        cal = res.eval["confidence_calibration"]
        assert cal["positions"] > 0 and math.isfinite(cal["scale"])
        assert read_metadata(res.final_checkpoint)["confidence_calibration"] == cal
        drafter = load_drafter(res.final_checkpoint)
        assert drafter.config == engine.drafter_config
        prompts = list(read_conversations(default_assets.heldout))[:2]
        result = evaluate_acceptance(
            engine.targets[0], drafter, engine.tokenizer, prompts, max_new_tokens=16, check_lossless=True
        )
        assert result.lossless_mismatches == 0 and result.confidence
        assert all(1 <= n <= 7 for n in result.acceptance_lengths)
        from dflash_core.evaluate import evaluate_checkpoint  # what `dflash-trainer eval` runs

        summary = evaluate_checkpoint(
            res.final_checkpoint, str(default_assets.heldout), max_prompts=1, max_new_tokens=12, check_lossless=True
        )
        assert summary["lossless_mismatches"] == 0 and summary["blocks"] > 0
    finally:
        engine.close()
