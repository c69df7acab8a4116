"""The target's fused layers on the GPU (marker gpu): for each family the daemon supports, the
recorded capture of the compiled layers gives the eager features up to rounding (bf16, and the
FP8 target), its replay gives what it recorded bit for bit for other micro-batches, and nothing
compiles after it was recorded (a capture at another length runs the eager layers). The compiled
layers' packed attention (flex over the mask's tiles) against SDPA under the same masks."""

import pytest
import torch

from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.engine.compile import compiled_graphs
from dflash_core.target import TargetModel
from dflash_core.target_fusion import relative_error
from tests.helpers import saved_models
from tests.test_serving_parity import parity_config

pytestmark = pytest.mark.gpu

SHAPE = ShapeConfig(seq_len=256, num_anchors=8, block_size=8)  # two tiles of the packed attention
FAMILIES = ["qwen3", "qwen3_sliding", "llama3", "qwen3_moe", "gemma3", "gpt_oss", "llama4", "mixtral"]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, target_tokenizer):
    return saved_models(tmp_path_factory, target_tokenizer, parity_config)


def _inputs(vocab: int, seed: int, seq_len: int = SHAPE.seq_len):
    shape = ShapeConfig(seq_len=seq_len, num_anchors=SHAPE.num_anchors, block_size=SHAPE.block_size)
    mb = synthetic_micro_batch(shape, vocab, 0, seed=seed)
    return [t.to("cuda:0") for t in (mb.input_ids, mb.position_ids, mb.doc_ids)]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_target_graph_gives_the_eager_features(family_dir, family, fp8):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 matmuls")
    try:
        target = TargetModel(family_dir(family), [1, 2], "cuda:0", teacher=True, fp8=fp8)
    except ValueError as e:  # gemma3's tiny widths are no multiple of 16: no linear FP8 takes
        pytest.skip(str(e))
    vocab = int(target.config.vocab_size)
    args = _inputs(vocab, 1)
    eager = target.capture_ungraphed(*args).clone()
    others = {seed: _inputs(vocab, seed) for seed in (2, 3)}
    eager_others = {seed: target.capture_ungraphed(*a).clone() for seed, a in others.items()}
    assert target.record_graph(SHAPE.seq_len) and target.fused
    fused = target.capture_ungraphed(*args).clone()
    error, layer = relative_error(fused, eager), target.fused_layer_error(*args)
    print(f"{family} {'fp8' if fp8 else 'bf16'}: relative error {error:.2e} of the features, {layer:.2e} of a layer")
    assert error <= target.fused_tolerance and layer <= target.fused_tolerance
    recorded = compiled_graphs()
    for seed, a in others.items():
        # other documents, so other masks: the replay reads this micro-batch's masks (their
        # BlockMasks are built in the graph, not kept from the recording), as the eager layers do
        graphed = target.capture(*a).clone()
        assert torch.equal(graphed, target.capture_ungraphed(*a)), seed
        assert relative_error(graphed, eager_others[seed]) <= target.fused_tolerance, seed
    other = _inputs(vocab, 4, seq_len=64)  # not the recorded length: the eager layers
    target.capture(*other)
    assert compiled_graphs() == recorded
    target.drop_graph()
    assert not target.fused and torch.equal(target.capture_ungraphed(*args), eager)


@pytest.mark.parametrize("window", [None, 300], ids=["full", "sliding"])
def test_packed_flex_attention_equals_sdpa_under_the_packed_mask(window):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash_core.target_attention import block_mask_of, packed_attention

    s, g = 2048, torch.Generator(device="cuda:0").manual_seed(0)
    doc = torch.repeat_interleave(torch.arange(5, device="cuda:0"), torch.tensor([700, 20, 900, 300, 128]).cuda())
    i = torch.arange(s, device="cuda:0")
    mask = (i[None] <= i[:, None]) & (doc[None] == doc[:, None])
    if window:
        mask &= i[None] > i[:, None] - window
    mask = mask[None, None]
    q, k, v = (torch.randn(1, h, s, 128, generator=g, device="cuda:0", dtype=torch.bfloat16) for h in (32, 8, 8))
    module = torch.nn.Module()
    module.num_key_value_groups = 4
    attention = packed_attention(sdpa_attention_forward)
    flex, _ = torch.compile(attention, dynamic=False)(module, q, k, v, mask, scaling=128**-0.5)
    sdpa, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=128**-0.5)
    error = relative_error(flex, sdpa)
    print(
        f"packed flex against SDPA: relative error {error:.2e}; tiles visited {block_mask_of(mask).to_dense().float().mean():.2f}"
    )
    assert error < 1e-2 and not torch.equal(flex, sdpa)  # rounding apart: another kernel ran
