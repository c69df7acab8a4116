"""The bytes bench/regenerate.py counts for a decode step's weights: every parameter and buffer
but the input embedding, an FP8 linear at one byte per weight (plus its scale), a tied table
counted once and read as the LM head; the weights its prefill's ideal time multiplies each prompt
token by."""

import pytest
import torch

from bench.regenerate import bound, main, new_token_counts, prefill_weights, serial_floor_ms, step_weight_bytes


def _tiny_qwen3(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_weights_without_the_input_embedding():
    model = _tiny_qwen3(tied=False)
    emb = model.get_input_embeddings().weight
    expected = _nbytes(model.parameters()) + _nbytes(model.buffers()) - _nbytes([emb])
    assert step_weight_bytes(model) == expected


def test_a_tied_table_is_read_as_the_lm_head():
    model = _tiny_qwen3(tied=True)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert step_weight_bytes(model) == _nbytes(model.parameters()) + _nbytes(model.buffers())


def test_fp8_linears_count_one_byte_per_weight():
    from torch import nn

    from dflash_core.target_precision import quantize_decoder_linears

    model = _tiny_qwen3(tied=False)
    before = step_weight_bytes(model)
    linears = [m for m in model.get_decoder().layers.modules() if type(m) is nn.Linear]
    weights = sum(m.weight.numel() for m in linears)
    assert quantize_decoder_linears(model.get_decoder().layers) is not None
    # two bytes per bf16 weight become one, and each linear gains an fp32 scale
    assert step_weight_bytes(model) == before - weights + 4 * len(linears)


def test_prefill_weights_are_the_layers():
    """Every weight but the embedding, the LM head and the final norm; as many once FP8 (one
    element per weight) plus each linear's scale."""
    from torch import nn

    from dflash_core.target_precision import quantize_decoder_linears

    model = _tiny_qwen3(tied=False)
    outside = [model.get_input_embeddings().weight, model.get_output_embeddings().weight, model.model.norm.weight]
    expected = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in outside)
    assert prefill_weights(model) == expected
    linears = sum(type(m) is nn.Linear for m in model.get_decoder().layers.modules())
    assert quantize_decoder_linears(model.get_decoder().layers) is not None
    assert prefill_weights(model) == expected + linears


def test_bound():
    # 10 slots, 1000 weight bytes, 5 positions of 20 bytes: 2000 bytes at 1000 B/s -> 5 tokens/s
    assert bound(10, 1000, 5, 20, 1000.0) == 5.0


def test_serial_floor_is_the_cache_read_then_the_slower_of_bytes_and_flops():
    model = _tiny_qwen3(tied=False)
    head = model.get_output_embeddings().weight
    head_bytes, layer_bytes = 2 * head.numel(), step_weight_bytes(model) - 2 * head.numel()
    bandwidth, cache = 1e6, 300  # 4 slots of 300 cache bytes
    # matmuls so fast that every GEMM is its weight bytes: the floor is the bandwidth bound
    fast = serial_floor_ms(model, 4, cache, bandwidth, 1e30, 1e30)
    assert abs(fast - (4 * cache + layer_bytes + head_bytes) / bandwidth * 1e3) < 1e-9
    # matmuls slow enough to be compute bound: each GEMM at its FLOPs, the head at its own rate
    slow = serial_floor_ms(model, 4, cache, bandwidth, 1.0, 2.0)
    expected = (4 * cache / bandwidth + 2 * 4 * prefill_weights(model) + 2 * 4 * head.numel() / 2.0) * 1e3
    assert abs(slow - expected) < 1e-6 * expected


def test_decode_gemm_shapes_are_the_models_linears():
    """bench/decode_gemms.py's shapes, times their calls, hold every linear weight of a Qwen3 of
    the preset's widths and the LM head, with q, k and v stacked as the decoder stacks them."""
    from collections import Counter

    from torch import nn
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench.common import QWEN3_8B
    from bench.decode_gemms import step_shapes

    preset = {**QWEN3_8B, "num_hidden_layers": 2, "vocab_size": 512}
    cfg = Qwen3Config(**{k: v for k, v in preset.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    found: Counter = Counter()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not name.endswith(("k_proj", "v_proj")):
            out = m.out_features
            if name.endswith("q_proj"):
                attn = model.get_submodule(name.rsplit(".", 1)[0])
                out += attn.k_proj.out_features + attn.v_proj.out_features
            found[(out, m.in_features)] += 1
    expected: Counter = Counter()
    for n, k, calls in step_shapes(preset).values():
        expected[(n, k)] += calls
    assert found == expected


def test_new_token_counts_spread_around_the_same_mean():
    assert new_token_counts(5, 512, 0.0) == [512] * 5
    counts = new_token_counts(4096, 512, 0.5, seed=3)
    assert counts == new_token_counts(4096, 512, 0.5, seed=3)  # the same requests in every row
    assert min(counts) >= 256 and max(counts) <= 768
    assert len(set(counts)) > 400  # sequences end at many different steps
    assert abs(sum(counts) / len(counts) - 512) < 8
    assert min(new_token_counts(200, 3, 0.9)) >= 1
    with pytest.raises(ValueError, match="spread"):
        new_token_counts(4, 512, 1.0)


def test_a_spread_outside_zero_to_one_is_refused_before_the_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--new-tokens-spread", "1.5"])
    assert e.value.code == 2
    assert "--new-tokens-spread" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prompt-len-spread", "1.0", "--hf-batch", "0"], "--prompt-len-spread takes"),
        (["--prompt-len-spread", "0.5"], "--hf-batch 0"),  # generate's row takes one prompt length
    ],
)
def test_a_prompt_length_spread_is_checked_before_the_gpu(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_a_ride_that_is_not_a_count_is_refused_before_the_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--ride", "0,half"])
    assert e.value.code == 2
    assert "--ride takes" in capsys.readouterr().err


def test_rides_are_counts_default_or_one_width():
    from bench.regenerate import parse_rides

    got = parse_rides("default, 0,512:widest,256,default:widest")
    assert got == [(None, False), (0, False), (512, True), (256, False), (None, True)]
    for bad in ("512:narrow", ":widest", "-4", "half"):
        with pytest.raises(ValueError, match="--ride takes"):
            parse_rides(bad)
