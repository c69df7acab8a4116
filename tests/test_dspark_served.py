"""A DSpark drafter as the public stacks serve it: anchor-first blocks, stated in config.json.

A DSpark drafter is trained on the embedded default with the public recipe (the daemon's own
engine and job), then decoded by an anchor-first loop written from DeepSpec's drafting code
(deepseek-ai/DeepSpec afdfa7c9, `deepspec/eval/dspark/draft_ops.py` `build_dspark_proposal`,
lines 96-153: the proposal is `block_hidden[:, :block_size]`, every slot of the block, sampled
left to right from the anchor as the first previous token, and verified as [anchor, drafts]).
That loop runs on what a serving stack has: the checkpoint directory loaded by transformers
through its shipped modeling file, and the target as a plain transformers causal LM. It must be
lossless and give the τ of the daemon's evaluator; the same weights read fill-in (the layout our
checkpoints used before they stated one) give far less, which is what a stack that guesses the
layout wrong serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_core.data.conversations import read_conversations
from dflash_core.defaults import DEFAULT_TARGET_LAYER_IDS
from dflash_core.engine import Engine, EngineConfig, TrainJob
from dflash_core.evaluate import evaluate_checkpoint, greedy_generate, prompt_ids, stop_ids
from dflash_core.target import TargetModel

PROMPTS = 6
NEW_TOKENS = 32
STEPS = 200


@pytest.fixture(scope="module")
def dspark_engine(default_assets):
    cfg = EngineConfig(
        drafter_devices=["cpu"],
        recipe="dspark",
        seq_len=256,
        num_anchors=32,
        drafter_layers=1,
        target_layer_ids=list(DEFAULT_TARGET_LAYER_IDS),
        markov_rank=32,
    )
    engine = Engine(cfg, default_assets.root.parent.parent).build()
    yield engine
    engine.close()


def _train(engine, default_assets, out: Path, steps: int, **kw) -> Path:
    job = TrainJob(
        datasets=[str(default_assets.train)], output_dir=str(out), steps=steps, checkpoint_interval=steps, **kw
    )
    engine.run_job(job)
    (config,) = sorted(out.rglob("step-*/config.json"))
    return config.parent


@pytest.fixture(scope="module")
def dspark_checkpoint(dspark_engine, default_assets, tmp_path_factory) -> Path:
    """A DSpark drafter trained with the recipe's defaults (anchor_first, block 7, gamma 4,
    0.1 CE + 0.9 L1 + 1.0 confidence) on the embedded default, as its last checkpoint."""
    return _train(dspark_engine, default_assets, tmp_path_factory.mktemp("dspark-served"), STEPS, learning_rate=3e-3)


def _heldout(default_assets, tokenizer, n=PROMPTS) -> list[list[int]]:
    return [prompt_ids(tokenizer, c.messages) for c in list(read_conversations(default_assets.heldout))[:n]]


@torch.no_grad()
def deepspec_style_decode(draft, target, prompt, *, max_new_tokens, stops, anchor_first=True):
    """Greedy speculative decoding as DeepSpec's evaluator drafts (see the module docstring),
    with the target re-run over the whole sequence each block (no cache: simple and exact).
    anchor_first=False reads the same block fill-in instead: slots 1..B-1 draft B-1 tokens."""
    cfg = draft.config
    layer_ids = list(cfg.target_layer_ids)
    block, mask_id = int(cfg.block_size), int(cfg.mask_token_id)
    embed = target.get_input_embeddings().weight
    lm_head = target.get_output_embeddings().weight
    w1 = draft.markov_head.markov_w1.weight
    w2 = draft.markov_head.markov_w2.weight

    def target_pass(ids):
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        return out.logits[0], feats

    ids = list(prompt)
    logits, feats = target_pass(ids)
    ids.append(int(logits[-1].argmax()))
    lengths = []
    while len(ids) - len(prompt) < max_new_tokens and ids[-1] not in stops:
        start = len(ids) - 1  # the anchor: generated, not yet seen by the target
        draft_input_ids = torch.tensor([[ids[start]] + [mask_id] * (block - 1)])
        position_ids = torch.arange(start + block).unsqueeze(0)
        block_hidden = draft(F_embed(draft_input_ids, embed), feats[:, :start], position_ids)
        proposal = block_hidden[0, :block] if anchor_first else block_hidden[0, 1:block]  # draft_ops.py:106
        base = proposal @ lm_head.t()  # draft_ops.py:107 compute_logits
        prev, drafts = ids[start], []  # draft_ops.py:110 first_prev_token_ids = draft_input_ids[:, 0]
        for k in range(base.shape[0]):  # the vanilla Markov head's sample_block_tokens, greedy
            prev = int((base[k] + w2 @ w1[prev]).argmax())
            drafts.append(prev)
        verify = [ids[start], *drafts]  # draft_ops.py:136-139 verify_input_ids
        logits, full = target_pass(ids[:start] + verify)
        posterior = logits[start:].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
            accepted += 1
        new = drafts[:accepted] + [posterior[accepted]]
        ids = ids[:start] + verify[:1] + new
        feats = full
        lengths.append(accepted + 1)
        if stops.intersection(new):
            break
    gen = ids[len(prompt) :][:max_new_tokens]
    cut = next((i + 1 for i, t in enumerate(gen) if t in stops), len(gen))
    return gen[:cut], lengths


def F_embed(ids: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.embedding(ids, embed)


@pytest.fixture(scope="module")
def served(dspark_checkpoint, default_assets):
    """The checkpoint as a serving stack loads it: transformers with the shipped modeling file,
    and the target as a plain transformers causal LM."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    draft = AutoModel.from_pretrained(str(dspark_checkpoint), trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(str(default_assets.target), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(default_assets.target))
    return draft, target, tokenizer


@pytest.mark.slow
def test_the_checkpoint_states_anchor_first_where_each_runtime_reads_it(dspark_checkpoint):
    conf = json.loads((dspark_checkpoint / "config.json").read_text())
    assert conf["architectures"] == ["DSparkDraftModel"] and conf["block_size"] == 7
    assert conf["sample_from_anchor"] is True  # speculators
    assert conf["dspark_bonus_anchor"] is False  # vLLM's DSpark speculator
    assert conf["dflash_config"]["sample_from_anchor"] is True
    assert conf["num_speculative_tokens"] == 7
    # DeepSpec's Qwen3DSparkModel reads these at the top level, vLLM under dflash_config
    for key in ("target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head"):
        assert conf[key] == conf["dflash_config"][key], key
    assert conf["confidence_head_with_markov"] is True and conf["num_anchors"] == 32


@pytest.mark.slow
def test_a_deepspec_style_anchor_first_decode_is_lossless_with_our_tau(dspark_checkpoint, served, default_assets):
    draft, target, tokenizer = served
    stops = stop_ids(tokenizer)
    prompts = _heldout(default_assets, tokenizer)
    ours_target = TargetModel(str(default_assets.target), list(DEFAULT_TARGET_LAYER_IDS), "cpu")
    anchor_first, fill_in = [], []
    for prompt in prompts:
        tokens, lengths = deepspec_style_decode(draft, target, prompt, max_new_tokens=NEW_TOKENS, stops=stops)
        assert tokens == greedy_generate(ours_target, prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=stops)
        anchor_first += lengths
        _, lengths = deepspec_style_decode(
            draft, target, prompt, max_new_tokens=NEW_TOKENS, stops=stops, anchor_first=False
        )
        fill_in += lengths
    tau = sum(anchor_first) / len(anchor_first)
    summary = evaluate_checkpoint(
        str(dspark_checkpoint),
        str(default_assets.heldout),
        target_path=str(default_assets.target),
        max_prompts=PROMPTS,
        max_new_tokens=NEW_TOKENS,
        check_lossless=True,
    )
    assert summary["lossless_mismatches"] == 0
    assert abs(summary["acceptance_length"] - tau) <= 0.05, (summary["acceptance_length"], tau)
    assert tau > 2.0, tau  # trained: the comparison below means something
    wrong = sum(fill_in) / len(fill_in)
    assert wrong < tau - 0.5, (wrong, tau)  # the layout a stack must not guess


@pytest.mark.slow
def test_the_shipped_spec_generate_decodes_anchor_first_losslessly(served, default_assets):
    draft, target, tokenizer = served
    stops = stop_ids(tokenizer)
    ours_target = TargetModel(str(default_assets.target), list(DEFAULT_TARGET_LAYER_IDS), "cpu")
    for prompt in _heldout(default_assets, tokenizer, n=3):
        out = draft.spec_generate(target, torch.tensor([prompt]), NEW_TOKENS, sorted(stops))
        want = greedy_generate(ours_target, prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=stops)
        assert out[0, len(prompt) :].tolist() == want


def _dflash_backbone(engine, path: Path, **changes) -> dict[str, torch.Tensor]:
    """A DFlash (fill_in, block 8) checkpoint with the DSpark engine's backbone; its weights."""
    from dataclasses import replace

    from dflash_core.checkpoint import save_checkpoint
    from dflash_core.drafter import DFlashDrafter

    mine = engine.drafter_config
    cfg = replace(mine, recipe="dflash", markov_rank=0, layout="fill_in", block_size=8, **changes)
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(7)
    save_checkpoint(path, drafter)
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


@pytest.mark.slow
def test_a_dflash_checkpoint_warm_starts_a_dspark_job(dspark_engine, default_assets, tmp_path):
    """ModelOpt's warm start: the backbone from DFlash, the heads fresh."""
    from safetensors.torch import load_file

    backbone = _dflash_backbone(dspark_engine, tmp_path / "dflash")
    out = _train(
        dspark_engine, default_assets, tmp_path / "out", 1, learning_rate=1e-9, init_from=str(tmp_path / "dflash")
    )
    masters = out / "training_state" / "master_weights.safetensors"  # where the export is not fp32
    got = load_file(str(masters if masters.is_file() else out / "model.safetensors"))
    for name, weight in backbone.items():
        assert torch.allclose(got[name].float(), weight.float(), atol=1e-6), name
    # the Markov bias starts at zero, as in a drafter trained from scratch
    assert float(got["markov_head.markov_w2.weight"].abs().max()) < 1e-6


@pytest.mark.slow
def test_a_backbone_of_other_widths_is_refused_naming_init_from(dspark_engine, default_assets, tmp_path):
    from dflash_core.engine.api import JobError

    mine = dspark_engine.drafter_config
    _dflash_backbone(dspark_engine, tmp_path / "wide", intermediate_size=mine.intermediate_size * 2)
    with pytest.raises(JobError) as e:
        _train(dspark_engine, default_assets, tmp_path / "out", 1, init_from=str(tmp_path / "wide"))
    assert e.value.field == "init_from" and "intermediate_size" in e.value.message
