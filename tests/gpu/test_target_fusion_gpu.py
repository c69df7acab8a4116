"""The target's fused layers on the GPU (marker gpu): for each family the daemon supports, the
recorded capture of the compiled layers gives the eager features up to rounding (bf16, and the
FP8 target), its replay gives what it recorded bit for bit for other micro-batches, and nothing
compiles after it was recorded (a capture at another length runs the eager layers)."""

import pytest
import torch

from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.engine.compile import compiled_graphs
from dflash_core.target import TargetModel
from dflash_core.target_fusion import FUSED_TOLERANCE, relative_error
from tests.helpers import saved_models
from tests.test_serving_parity import parity_config

pytestmark = pytest.mark.gpu

SHAPE = ShapeConfig(seq_len=128, num_anchors=8, block_size=8)
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
    assert target.record_graph(SHAPE.seq_len) and target.fused
    fused = target.capture_ungraphed(*args).clone()
    error, layer = relative_error(fused, eager), target.fused_layer_error(*args)
    print(f"{family} {'fp8' if fp8 else 'bf16'}: relative error {error:.2e} of the features, {layer:.2e} of a layer")
    assert error <= FUSED_TOLERANCE and layer <= FUSED_TOLERANCE
    recorded = compiled_graphs()
    for seed in (2, 3):
        a = _inputs(vocab, seed)
        graphed = target.capture(*a).clone()
        assert torch.equal(graphed, target.capture_ungraphed(*a)), seed
    other = _inputs(vocab, 4, seq_len=64)  # not the recorded length: the eager layers
    target.capture(*other)
    assert compiled_graphs() == recorded
    target.drop_graph()
    assert not target.fused and torch.equal(target.capture_ungraphed(*args), eager)
