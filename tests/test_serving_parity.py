"""Train/serve parity: for every target family we accept, the drafter's training-time inputs (the
block embeddings of the training step and the captured context features) equal what the public
reference loop (z-lab `dflash_generate`) computes for the same tokens:

- block input: `F.embedding(ids, target.get_input_embeddings().weight) * input_embedding_scale`
  read from the exported config.json (the reference today), and `target.model.embed_tokens(ids)`
  (the reference before it read the scale): bit for bit, in the target's bf16;
- context: `cat(hidden_states[id + 1] for id in target_layer_ids)` of the target's forward with
  `output_hidden_states=True`, from one document and from a packed sequence.

A target whose inputs we cannot reproduce is refused at warm-up, with the reason."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_core.checkpoint import hf_config
from dflash_core.config import DrafterConfig, ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.engine.warmup import serving_inputs
from dflash_core.parity import TargetRefused
from dflash_core.step.blocks import block_inputs
from dflash_core.step.micro_step import block_embeddings
from dflash_core.target import TargetModel
from tests.helpers import saved_models
from tests.test_targets import _common, family_config

LAYER_IDS = [1, 2]  # of 4: the last layer is refused (its reference feature is after the final norm)
SHAPE = ShapeConfig(seq_len=64, num_anchors=6, block_size=8)


def parity_config(name: str, tok):
    """The families of tests/test_targets.py, and Mistral, Mixtral, Gemma 3 (an embedding module
    that scales by sqrt(hidden): 72 here, so the scale, 8.485, rounds to 8.5 in bf16) and
    Gemma 2 (soft-capped logits: refused)."""
    import transformers as tf

    c = _common(tok)
    if name == "mistral":
        return tf.MistralConfig(**c, sliding_window=8)
    if name == "mixtral":
        return tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    if name == "gemma3":
        return tf.Gemma3TextConfig(**{**c, "hidden_size": 72}, sliding_window=8, sliding_window_pattern=2)
    if name == "gemma2":
        return tf.Gemma2Config(**c, sliding_window=8)
    return family_config(name, tok)


ACCEPTED = ["qwen3", "qwen3_sliding", "qwen3_yarn", "llama3", "llama4", "mistral", "mixtral"]
ACCEPTED += ["qwen3_moe", "gemma3", "gpt_oss"]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, target_tokenizer):
    return saved_models(tmp_path_factory, target_tokenizer, parity_config)


def exported_config(target: TargetModel, layer_ids=LAYER_IDS) -> dict:
    """config.json as our export writes it for a drafter of this target (after warm-up's checks)."""
    cfg = DrafterConfig.from_target_config(
        target.config, num_hidden_layers=1, block_size=SHAPE.block_size, mask_token_id=5, target_layer_ids=layer_ids
    )
    cfg = serving_inputs(cfg, target)
    return json.loads(json.dumps(hf_config(cfg, target.dtype)))


def reference_context(target: TargetModel, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The reference loop's `extract_context_feature(output.hidden_states, layer_ids)`."""
    out = target.model(ids.view(1, -1), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0]


@pytest.mark.parametrize("family", ACCEPTED)
def test_block_embeddings_equal_the_reference(family_dir, family):
    target = TargetModel(family_dir(family), LAYER_IDS, "cpu", dtype=torch.bfloat16)
    exported = exported_config(target)
    scale = exported["dflash_config"]["input_embedding_scale"]
    if family == "gemma3":
        assert scale == 8.5  # sqrt(72) in bf16, as Gemma3TextScaledWordEmbedding multiplies
    else:
        assert scale == 1.0
    head = target.frozen_head().to("cpu", torch.bfloat16)
    batch = synthetic_micro_batch(SHAPE, target.config.vocab_size, 0)
    ids, _ = block_inputs(batch, SHAPE.block_size, exported["dflash_config"]["mask_token_id"])
    ours = block_embeddings(head, ids)[0]  # what the training step feeds the drafter
    module = target.model.get_input_embeddings()
    with torch.no_grad():
        today = F.embedding(ids.view(1, -1), module.weight) * float(scale)
        before = module(ids.view(1, -1))
    assert ours.dtype == today.dtype == torch.bfloat16
    assert torch.equal(ours, today[0]), family
    assert torch.equal(ours, before[0]), family
    # the LM head stays the target's, unscaled (Gemma ties it to the embedding)
    assert torch.equal(head.lm_head_weight, target.model.get_output_embeddings().weight)


@pytest.mark.parametrize("family", ACCEPTED)
def test_context_features_equal_the_reference(family_dir, family):
    target = TargetModel(family_dir(family), LAYER_IDS, "cpu", dtype=torch.float32)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(6, vocab, (n,), generator=gen) for n in (19, 27)]  # past the windows of 8
    packed_ids = torch.cat(docs)
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])
    positions = torch.cat([torch.arange(len(d)) for d in docs])
    packed = target.capture(packed_ids, positions, doc_ids)
    at = 0
    for d in docs:
        with torch.no_grad():
            want = reference_context(target, d, LAYER_IDS)
        alone = target.capture(d, torch.arange(len(d)), torch.zeros(len(d), dtype=torch.long))
        scale = want.abs().max()
        assert (alone - want).abs().max() <= 1e-5 * scale, family
        assert (packed[at : at + len(d)] - want).abs().max() <= 1e-5 * scale, family
        at += len(d)


def test_gemma3_trains_on_scaled_embeddings(family_dir):
    """The scale is folded into the table once; the table is not the raw one."""
    target = TargetModel(family_dir("gemma3"), LAYER_IDS, "cpu", dtype=torch.float32)
    raw = target.model.get_input_embeddings().weight
    folded = target.frozen_head().embed_weight
    assert target.embedding_scale == pytest.approx(72**0.5)
    assert torch.equal(folded, raw * target.embedding_scale)
    assert folded.data_ptr() != raw.data_ptr()
    plain = TargetModel(family_dir("qwen3"), LAYER_IDS, "cpu", dtype=torch.float32)
    assert plain.frozen_head().embed_weight.data_ptr() == plain.model.get_input_embeddings().weight.data_ptr()


# --- refused at warm-up, with the reason ----------------------------------------------------------


def test_soft_capped_logits_are_refused(family_dir):
    target = TargetModel(family_dir("gemma2"), LAYER_IDS, "cpu")
    with pytest.raises(TargetRefused, match=r"soft-caps its logits \(final_logit_softcapping=30.0\)"):
        exported_config(target)


def test_the_last_layer_is_refused(family_dir):
    target = TargetModel(family_dir("qwen3"), [1, 3], "cpu")
    with pytest.raises(TargetRefused, match=r"include the last decoder layer \(3\).*hidden_states\[4\]"):
        exported_config(target, [1, 3])
    # why: the reference's feature of the last layer is the final norm's output, not the layer's
    with torch.no_grad():
        ids = torch.arange(6, 20)
        ours = target.capture(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
        assert not torch.allclose(ours, reference_context(target, ids, [1, 3]), atol=1e-3)


def test_an_embedding_that_is_not_a_scaled_lookup_is_refused(family_dir):
    class ShiftedEmbedding(torch.nn.Embedding):  # what serving's F.embedding * scale cannot reproduce
        def forward(self, ids):
            return super().forward(ids) + 1.0

    target = TargetModel(family_dir("qwen3"), LAYER_IDS, "cpu")
    old = target.model.get_input_embeddings()
    new = ShiftedEmbedding(old.num_embeddings, old.embedding_dim)
    new.weight = old.weight
    target.model.set_input_embeddings(new)
    with pytest.raises(TargetRefused, match="ShiftedEmbedding does not compute weight"):
        exported_config(target)


def test_the_engine_refuses_at_warm_up(family_dir, default_assets):
    from dflash_core.engine import Engine, EngineConfig

    cfg = EngineConfig(
        target_path=family_dir("gemma2"),
        drafter_devices=["cpu"],
        seq_len=SHAPE.seq_len,
        num_anchors=SHAPE.num_anchors,
        block_size=SHAPE.block_size,
        drafter_layers=1,
        target_layer_ids=LAYER_IDS,
    )
    engine = Engine(cfg, default_assets.root.parent.parent)
    with pytest.raises(TargetRefused, match="soft-caps"):
        engine.build()
    engine.close()


def test_the_engine_trains_gemma3_on_the_serving_inputs(family_dir, default_assets, tmp_path):
    """Through the real engine: the checkpoint records the scale the reference multiplies by, and
    the drafter decodes losslessly with the evaluator's (scaled) head."""
    from dflash_core.checkpoint import load_drafter
    from dflash_core.data.conversations import read_conversations
    from dflash_core.engine import Engine, EngineConfig, TrainJob
    from dflash_core.evaluate import evaluate_acceptance

    cfg = EngineConfig(
        target_path=family_dir("gemma3"),
        drafter_devices=["cpu"],
        seq_len=128,
        num_anchors=8,
        block_size=SHAPE.block_size,
        drafter_layers=1,
        target_layer_ids=LAYER_IDS,
    )
    engine = Engine(cfg, default_assets.root.parent.parent).build()
    try:
        res = engine.run_job(
            TrainJob(datasets=[str(default_assets.train)], output_dir=str(tmp_path), steps=3, checkpoint_interval=3)
        )
        assert res.status == "SUCCEEDED"
        conf = json.loads((tmp_path / res.final_checkpoint / "config.json").read_text())
        scale = engine.targets[0].embedding_scale
        assert conf["dflash_config"]["input_embedding_scale"] == scale == pytest.approx(72**0.5)
        drafter = load_drafter(res.final_checkpoint)
        assert drafter.config.input_embedding_scale == scale
        prompts = list(read_conversations(default_assets.heldout))[:1]
        result = evaluate_acceptance(
            engine.targets[0], drafter, engine.tokenizer, prompts, max_new_tokens=12, check_lossless=True
        )
        assert result.lossless_mismatches == 0
    finally:
        engine.close()
