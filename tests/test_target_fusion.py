"""The target's fused layers (target_fusion.py) on the CPU: one compiled graph serves every
decoder layer, the capture hooks still see the captured layers, the features equal the eager
ones up to rounding, and removing the fusion gives the layers their own forward back. (The
engine fuses only a target it records as a CUDA graph: tests/gpu/test_target_fusion_gpu.py.)"""

import threading

import torch

from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.engine.compile import compiled_graphs
from dflash_core.target import TargetModel
from dflash_core.target_attention import BLOCK_MASK, TILE, use_packed_attention
from dflash_core.target_fusion import FUSED_TOLERANCE, FUSED_TOLERANCE_FP8, LayerFusion, relative_error
from dflash_core.thread_switch import ThreadSwitch


def test_fused_layers_give_the_eager_features_with_one_graph(assets_dir):
    target = TargetModel(assets_dir / "target", [0, 1], "cpu", teacher=True)
    mb = synthetic_micro_batch(ShapeConfig(seq_len=64, num_anchors=4, block_size=8), 125, 0, seed=1)
    args = (mb.input_ids, mb.position_ids, mb.doc_ids)
    eager = target.capture_ungraphed(*args)
    assert target.fused_tolerance == FUSED_TOLERANCE  # bf16 linears
    layers = target.decoder_layers()
    fusion = LayerFusion(layers)
    before = compiled_graphs()
    with fusion.active():
        fused = target.capture_ungraphed(*args)
        again = target.capture_ungraphed(*args)
    assert compiled_graphs() - before == 1  # every layer shares the one compiled graph
    assert torch.equal(fused, again)
    assert fused.shape == eager.shape and relative_error(fused, eager) <= FUSED_TOLERANCE
    assert torch.equal(target.capture_ungraphed(*args), eager)  # outside active(): the eager layers
    assert 0 < fusion.layer_error(lambda: target.capture_ungraphed(*args)) <= FUSED_TOLERANCE
    assert compiled_graphs() - before == 1
    fusion.remove()
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_a_forward_builds_each_masks_block_mask_once_for_all_layers(assets_dir):
    """At a length of whole flex tiles, the fused forward builds the packed attention's BlockMask
    of its one mask once, outside the compiled layers, and hands it to every layer's attention
    function: still one graph, the same features, and nothing built outside the forward. (On the
    CPU the flex path itself is not taken; the GPU test runs it.)"""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import AttentionInterface

    target = TargetModel(assets_dir / "target", [0, 1], "cpu", teacher=True)
    mb = synthetic_micro_batch(ShapeConfig(seq_len=2 * TILE, num_anchors=4, block_size=8), 125, 0, seed=2)
    args = (mb.input_ids, mb.position_ids, mb.doc_ids)
    eager = target.capture_ungraphed(*args)
    use_packed_attention()
    packed = AttentionInterface._global_mapping["sdpa"]

    def handed_a_block_mask(module, query, key, value, mask, **kwargs):
        if not isinstance(kwargs.get(BLOCK_MASK), BlockMask):  # traced by dynamo: a raise, not a record
            raise AssertionError("the attention got no BlockMask")
        return packed(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("sdpa", handed_a_block_mask)
    fusion = LayerFusion(target.decoder_layers())
    try:
        before = compiled_graphs()
        with fusion.active() as masks:
            fused = target.capture_ungraphed(*args)
        assert len(target.decoder_layers()) > 1 and len(masks) == 1
        assert compiled_graphs() - before == 1
        assert relative_error(fused, eager) <= FUSED_TOLERANCE
        with fusion.active() as again:
            assert torch.equal(target.capture_ungraphed(*args), fused)
        assert again is not masks and len(again) == 1
        assert compiled_graphs() - before == 1
    finally:
        fusion.remove()
        AttentionInterface.register("sdpa", packed)
        use_packed_attention(False)


def test_the_switch_carries_its_value_per_thread_and_per_scope():
    """ThreadSwitch: on() carries a value for its block (yielded), a nested block its own until it
    ends; another thread sees the switch off and no value."""
    switch = ThreadSwitch()
    seen = []
    with switch.on("outer") as outer:
        with switch.on("inner") as inner:
            seen.append((switch.is_on, switch.value))
            other = threading.Thread(target=lambda: seen.append((switch.is_on, switch.value)))
            other.start()
            other.join()
        seen.append((switch.value, outer, inner))
    seen.append((switch.is_on, switch.value))
    assert seen == [(True, "inner"), (False, None), ("outer", "outer", "inner"), (False, None)]


def test_an_fp8_targets_fused_layer_is_one_graph(assets_dir):
    """An FP8 target's linears are traced into the compiled layer with their input casts: one
    graph serves every layer (no graph break at each linear), and the features are the eager
    ones (the shared per-thread casts) up to FP8's tolerance."""
    target = TargetModel(assets_dir / "target", [0, 1], "cpu", teacher=True, fp8=True)
    mb = synthetic_micro_batch(ShapeConfig(seq_len=64, num_anchors=4, block_size=8), 125, 0, seed=1)
    args = (mb.input_ids, mb.position_ids, mb.doc_ids)
    eager = target.capture_ungraphed(*args)
    assert target.fused_tolerance == FUSED_TOLERANCE_FP8
    fusion = LayerFusion(target.decoder_layers())
    before = compiled_graphs()
    with fusion.active():
        fused = target.capture_ungraphed(*args)
    assert compiled_graphs() - before == 1
    assert fused.shape == eager.shape and relative_error(fused, eager) <= FUSED_TOLERANCE_FP8
    assert fusion.layer_error(lambda: target.capture_ungraphed(*args)) <= FUSED_TOLERANCE_FP8
    fusion.remove()
    assert torch.equal(target.capture_ungraphed(*args), eager)
