"""Real target families: tiny random targets saved by transformers (Qwen3, Qwen3 + YaRN, Llama 3.1
RoPE, Qwen3-MoE, gpt-oss) go through the real engine; packed capture equals each document run
alone (sliding windows, chunked attention and attention sinks included); the drafter's RoPE
follows the target's, and the checkpoint's config.json gives transformers the same rotary
embedding."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.common import dims
from dflash_core.checkpoint import config_from_hf, hf_config, load_drafter
from dflash_core.config import DrafterConfig, ShapeConfig
from dflash_core.data.conversations import read_conversations
from dflash_core.drafter import DFlashDrafter
from dflash_core.engine import Engine, EngineConfig, JobCallbacks, TrainJob
from dflash_core.engine.warmup import check_rope_positions
from dflash_core.evaluate import evaluate_acceptance
from dflash_core.target import TargetModel, attention_implementation
from tests.helpers import assets_job, build_engine, saved_models, small_engine_config, train_spec

SHAPE = ShapeConfig(seq_len=256, num_anchors=32, block_size=8)
HEAD_DIM = 16


def _common(tok) -> dict:
    return dict(
        vocab_size=len(tok),
        **dims(64, 128, 4, 4, 2, HEAD_DIM),
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
    "rope_theta": 500000.0,
}


def family_config(name: str, tok):
    import transformers as tf

    c = _common(tok)
    needs = {"llama4": "Llama4TextConfig", "gpt_oss": "GptOssConfig"}.get(name)
    if needs and not hasattr(tf, needs):
        pytest.skip(f"this transformers has no {needs}")
    if name == "qwen3":
        return tf.Qwen3Config(**c)
    if name == "qwen3_sliding":  # layers 1.. slide over 8 tokens (layer_types mixes both kinds)
        return tf.Qwen3Config(**c, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if name == "qwen3_yarn":
        return tf.Qwen3Config(**c, rope_parameters=dict(YARN))
    if name == "llama3":  # Llama-3.1-style RoPE
        return tf.LlamaConfig(**c, rope_parameters=dict(LLAMA3))
    if name == "llama4":  # Llama 4 text: chunked attention (chunks of 8) and a full layer, MoE
        return tf.Llama4TextConfig(
            **c, intermediate_size_mlp=128, attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1
        )
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if name == "gpt_oss":  # alternating sliding (window 8) and full layers, attention sinks, MoE, YaRN
        return tf.GptOssConfig(
            **{**c, "intermediate_size": 64, "max_position_embeddings": 131072},
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
        )
    raise KeyError(name)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, target_tokenizer):
    """name -> directory of a tiny random target of that family, saved by transformers."""
    return saved_models(tmp_path_factory, target_tokenizer, family_config)


# --- capture: a packed sequence gives each document's own features ---------------------------


@pytest.mark.parametrize("family", ["qwen3", "qwen3_sliding", "qwen3_yarn", "llama3", "llama4", "qwen3_moe", "gpt_oss"])
def test_packed_capture_equals_documents_alone(target_dir, target_tokenizer, family):
    target = TargetModel(target_dir(family), [1, 3], "cpu")
    assert target.model.config._attn_implementation == attention_implementation(target.config)
    vocab, pad = target.config.vocab_size, target_tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(6, vocab, (n,), generator=gen) for n in (21, 13, 30)]  # past windows and chunks
    seq_len = 72  # and padding after them
    ids = torch.full((seq_len,), pad)
    doc_ids = torch.full((seq_len,), -1)
    pos = torch.zeros(seq_len, dtype=torch.long)
    at = 0
    for i, d in enumerate(docs):
        ids[at : at + len(d)], doc_ids[at : at + len(d)], pos[at : at + len(d)] = d, i, torch.arange(len(d))
        at += len(d)
    packed = target.capture(ids, pos, doc_ids)
    at = 0
    for d in docs:
        _, alone = target.forward_logits(d)  # the model's own masks, one document
        got = packed[at : at + len(d)]
        assert (got - alone).abs().max() <= 1e-5 * alone.abs().max(), family
        at += len(d)


def test_gpt_oss_runs_eager_and_qwen3_sdpa(target_dir):
    from transformers import AutoConfig

    assert attention_implementation(AutoConfig.from_pretrained(target_dir("qwen3"))) == "sdpa"
    assert attention_implementation(AutoConfig.from_pretrained(target_dir("gpt_oss"))) == "eager"


@pytest.mark.parametrize(("family", "builds"), [("qwen3", True), ("gpt_oss", False)])
def test_the_fused_layers_build_block_masks_only_for_sdpa_targets(target_dir, family, builds):
    """The packed flex path stands in front of transformers' SDPA; gpt-oss runs eager attention
    (its sinks), whose layers would be handed BlockMasks they never read: its fused forwards build
    none. Without the packed path, no target's do."""
    target = TargetModel(target_dir(family), [1, 3], "cpu")
    for packed in (True, False):
        fusion = target.layer_fusion(packed)
        try:
            with fusion.active() as masks:
                assert (masks is not None) is (builds and packed), (family, packed)
        finally:
            fusion.remove()


# --- RoPE: the drafter's is the target's, and its checkpoint config says so ---------------------


def drafter_for(target_config, **kw) -> DrafterConfig:
    return DrafterConfig.from_target_config(target_config, num_hidden_layers=1, block_size=8, mask_token_id=5, **kw)


@pytest.mark.parametrize("family", ["qwen3_yarn", "llama3", "gpt_oss"])
def test_drafter_rope_equals_the_target_rotary_embedding(target_dir, family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir(family)))
    rotary = DFlashDrafter(drafter_for(model.config)).rotary
    assert rotary.attention_scaling != 1.0 or family == "llama3"
    positions = torch.arange(0, 1000, 7)
    want_cos, want_sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = (t[0] for t in rotary(positions, torch.float32))
    if want_cos.shape[-1] == HEAD_DIM // 2:  # gpt-oss returns each frequency once (it rotates halves)
        cos, sin = cos[..., : HEAD_DIM // 2], sin[..., : HEAD_DIM // 2]
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)


def rope_target_configs():
    import transformers as tf

    c = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, vocab_size=128)
    return {
        "default": tf.Qwen3Config(**c, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        "linear": tf.Qwen3Config(**c, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        "dynamic": tf.LlamaConfig(
            **c, max_position_embeddings=512, rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=1e4
        ),  # the legacy spelling
        "yarn": tf.Qwen3Config(**c, max_position_embeddings=1024, rope_parameters=dict(YARN)),
        "llama3": tf.LlamaConfig(**c, max_position_embeddings=1024, rope_parameters=dict(LLAMA3)),
        "longrope": tf.Phi3Config(  # Phi-3: original_max_position_embeddings beside rope_scaling, no factor
            **c,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
            max_position_embeddings=4096,
            original_max_position_embeddings=256,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + i / 10 for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)],
            },
        ),
    }


@pytest.mark.parametrize("rope_type", ["default", "linear", "dynamic", "yarn", "llama3", "longrope"])
def test_checkpoint_config_gives_transformers_the_drafter_rope(rope_type):
    """config.json -> transformers' Qwen3Config -> Qwen3RotaryEmbedding (what the reference
    drafter builds) gives the drafter's cos/sin at every position the engine trains on."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = drafter_for(rope_target_configs()[rope_type])
    assert cfg.rope_type == rope_type
    on_disk = json.loads(json.dumps(hf_config(cfg, torch.float32)))
    assert config_from_hf(on_disk) == cfg
    reference = Qwen3RotaryEmbedding(Qwen3Config.from_dict(on_disk))
    rotary = DFlashDrafter(cfg).rotary
    assert rotary.attention_scaling == pytest.approx(reference.attention_scaling)
    end = cfg.rope_position_limit or 2048
    positions = torch.arange(end)
    want_cos, want_sin = reference(torch.zeros(1), positions[None])
    cos, sin = (t[0] for t in rotary(positions, torch.float32))
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)
    if rope_type == "default":
        assert on_disk["rope_scaling"] is None
    else:
        assert on_disk["rope_scaling"]["rope_type"] == rope_type == on_disk["rope_parameters"]["rope_type"]
        assert "partial_rotary_factor" not in on_disk["rope_parameters"]  # Phi-3 has one; Qwen3 rotates it all
    if rope_type == "longrope":  # where transformers 4 reads it
        assert on_disk["original_max_position_embeddings"] == 256


def test_dynamic_and_longrope_limit_the_training_positions():
    configs = rope_target_configs()
    dynamic, longrope = drafter_for(configs["dynamic"]), drafter_for(configs["longrope"])
    assert (dynamic.rope_position_limit, longrope.rope_position_limit) == (512, 256)
    assert drafter_for(configs["yarn"]).rope_position_limit is None
    check_rope_positions(longrope, 249, 8)  # positions 0..255
    with pytest.raises(ValueError, match=r"'longrope' RoPE .* use seq_len <= 249"):
        check_rope_positions(longrope, 250, 8)
    # past the limit the reference takes other frequencies: the long factors
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    reference = Qwen3RotaryEmbedding(Qwen3Config.from_dict(hf_config(longrope, torch.float32)))
    cos_short, _ = reference(torch.zeros(1), torch.arange(256)[None])
    cos_long, _ = reference(torch.zeros(1), torch.arange(257)[None])
    assert not torch.allclose(cos_short[0, 100], cos_long[0, 100])


def test_checkpoints_without_rope_parameters_still_load():
    base = hf_config(drafter_for(rope_target_configs()["default"]), torch.float32)
    for legacy in ({"rope_theta": 5e5, "rope_type": "default"}, None):  # as written before rope_parameters
        old = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_scaling": legacy}
        cfg = config_from_hf(old)
        assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_type) == (5e5, None, "default")
    yarn = hf_config(drafter_for(rope_target_configs()["yarn"]), torch.float32)
    del yarn["rope_parameters"]
    assert config_from_hf(yarn).rope_scaling == {k: v for k, v in YARN.items() if k != "rope_theta"}


def test_unsupported_rope_is_refused():
    cfg = drafter_for(rope_target_configs()["default"])
    with pytest.raises(ValueError, match="not supported"):
        DrafterConfig(**{**cfg.to_dict(), "target_layer_ids": (1,), "rope_scaling": {"rope_type": "mrope"}})


# --- the engine trains a drafter for each family, and its checkpoint decodes losslessly ---------


class Losses(JobCallbacks):
    def __init__(self):
        self.losses: list[float] = []

    def on_step(self, stats):
        self.losses.append(stats.loss)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_yarn", "llama3", "qwen3_moe", "gpt_oss"])
def test_engine_trains_a_lossless_drafter(target_dir, default_assets, tmp_path, family):
    path = target_dir(family)
    cfg = EngineConfig(
        target_path=path,
        drafter_devices=["cpu"],
        seq_len=SHAPE.seq_len,
        num_anchors=SHAPE.num_anchors,
        block_size=SHAPE.block_size,
        drafter_layers=2,
        target_layer_ids=[1, 2],  # the last layer's feature is refused (parity.check_serving_parity)
    )
    engine = Engine(cfg, default_assets.root.parent.parent).build()
    try:
        job = TrainJob(**train_spec(default_assets, tmp_path, 20))
        rec = Losses()
        res = engine.run_job(job, rec)
        assert res.status == "SUCCEEDED" and res.steps_done == 20
        assert all(math.isfinite(x) for x in rec.losses) and sum(rec.losses[-5:]) < sum(rec.losses[:5])
        assert engine.status().compiles["runtime"] == 0
        drafter = load_drafter(res.final_checkpoint)
        assert drafter.config == engine.drafter_config
        assert drafter.config.rope_scaling == drafter_for(engine.targets[0].config).rope_scaling
        prompts = list(read_conversations(default_assets.heldout))[:3]
        result = evaluate_acceptance(
            engine.targets[0], drafter, engine.tokenizer, prompts, max_new_tokens=24, check_lossless=True
        )
        assert result.lossless_mismatches == 0
        assert result.acceptance_lengths and all(1 <= n <= SHAPE.block_size for n in result.acceptance_lengths)
        assert math.isfinite(result.acceptance_length)
    finally:
        engine.close()


def test_a_target_split_over_two_stages_gives_the_same_features(default_assets):
    """One target copy split by layers over two devices ([["cpu", "cpu"]]: two CPU stages, each
    boundary crossed by the stage pre-hooks) captures the same features and logits as one copy."""
    from dflash_core.config import ShapeConfig
    from dflash_core.data.batches import synthetic_micro_batch
    from dflash_core.target import TargetModel

    layer_ids = [1, 2]
    whole = TargetModel(default_assets.target, layer_ids, "cpu")
    split = TargetModel(default_assets.target, layer_ids, ["cpu", "cpu"])
    assert split.label == "cpu+cpu" and len(split.stages) == 2
    mb = synthetic_micro_batch(ShapeConfig(seq_len=128, num_anchors=8, block_size=8), 64, 0)
    a = whole.capture(mb.input_ids, mb.position_ids, mb.doc_ids)
    b = split.capture(mb.input_ids, mb.position_ids, mb.doc_ids)
    assert torch.equal(a, b)
    logits_a, feats_a = whole.forward_logits(mb.input_ids[:40])
    logits_b, feats_b = split.forward_logits(mb.input_ids[:40])
    assert torch.equal(logits_a, logits_b) and torch.equal(feats_a, feats_b)
    hooked = [m for m in split.decoder_layers() if m._forward_pre_hooks]
    assert len(hooked) == len(split.decoder_layers())  # every layer crosses to its stage's device


def test_engine_trains_with_a_split_target(default_assets, tmp_path):
    engine = build_engine(small_engine_config(target_devices=[["cpu", "cpu"]]), default_assets)
    try:
        assert [w.device for w in engine.status().warmup if w.component == "target_load"] == ["cpu+cpu"]
        res = engine.run_job(assets_job(default_assets, tmp_path, 3))
        assert res.status == "SUCCEEDED"
    finally:
        engine.close()


def test_target_layers_fed_to_the_drafter_are_distinct():
    """The reference rule where the target is deep enough; a shallow target gets distinct layers
    spread over all of its own, one shallower than the drafter is refused, and so are given ids
    that name a layer twice."""
    from transformers import Qwen3Config

    from dflash_core.config import DrafterConfig, build_target_layer_ids

    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    for layers in range(1, 41):
        for drafter in range(1, min(layers, 8) + 1):
            ids = build_target_layer_ids(layers, drafter)
            assert len(set(ids)) == drafter and all(0 <= i < layers for i in ids), (layers, drafter, ids)
    assert build_target_layer_ids(4, 2) == [0, 3]
    with pytest.raises(ValueError, match="distinct target layers"):
        build_target_layer_ids(3, 5)
    tiny = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=16)  # fmt: skip
    assert DrafterConfig.from_target_config(
        tiny, num_hidden_layers=2, block_size=4, mask_token_id=1
    ).target_layer_ids == (0, 3)
    with pytest.raises(ValueError, match="more than once"):
        DrafterConfig.from_target_config(
            tiny, num_hidden_layers=2, block_size=4, mask_token_id=1, target_layer_ids=[1, 1]
        )
