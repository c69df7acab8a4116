"""The decode step's attention over each slot's valid cache positions: the Triton kernels
(dflash_core/kernels/decode_attention.py) through Triton's interpreter against a float64 masked
softmax and against the masked path, the slot decoder with them against the decoder without them
and transformers' generate, and the ranges the decoder hands them."""

from __future__ import annotations

import pytest
import torch

from dflash_core.regenerate.attention import decode_ranges, is_ranges, kernel_available
from tests.helpers import run_interpreted_check


@pytest.fixture(scope="module")
def checked():
    return run_interpreted_check("tests.decode_attention_check", "--decoder")


@pytest.mark.parametrize(
    "name",
    [
        "gqa1_d64",
        "gqa4_d128",
        "gqa4_d128_splits4",
        "gqa1_d64_splits4",
        "gqa4_d64_window",
        "gqa4_d64_window_splits4",
        "gqa2_d80_odd_dims",
        "fp32_splits7",
        "fp32_window",
        "fp32_gqa1_window_splits4",
        "gqa4_d256_splits2",
        "long_default_splits",
    ],
)
def test_kernel_equals_the_masked_softmax(checked, name):
    """Slots at position 0, at split ends and at the cache's last position, GQA groups 1, 2 and
    4, head dims 64, 80, 128 and 256, sliding windows, one split and several (given, and the default
    for few slots over a long cache); NaN in every cache
    position outside a slot's range, so a read of one shows."""
    got = checked["kernel"][name]
    assert got["finite"] and got["dtype_kept"], got
    tol = 1e-5 if name.startswith("fp32") else 1e-2  # bf16: the output's rounding and p's
    assert got["rel"] < tol, got
    assert got["vs_masked"] < 2 * tol, got


@pytest.mark.parametrize("cls", ["LlamaRMSNorm", "Qwen3RMSNorm", "Gemma3RMSNorm"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("width", [384, 64, 80])
def test_norm_kernel_equals_the_norm_classes(checked, cls, dtype, width):
    """Each class matched with its own weighting (a wrong one is off by the output's size), the
    kernel's output within the rounding of the output dtype: one bf16 step of the normalised row
    and one of the product (fp32: the sum's order alone)."""
    got = checked["norms"][f"{cls}_{dtype}_{width}"]
    assert got["weighting"] == ("offset" if cls == "Gemma3RMSNorm" else "scaled"), got
    assert got["dtype_kept"], got
    assert got["rel"] < (1e-5 if dtype == "float32" else 2e-2), got


@pytest.mark.parametrize("case", ["64_6", "80_6", "64_300", "80_300"])
def test_norm_kernel_reads_heads_in_place_from_a_wider_row(checked, case):
    """The query and key heads as columns of the stacked q/k/v output: no copy, the same bits."""
    got = checked["norms"][f"slice_{case}"]
    assert got["strided"] and got["equal"], got


@pytest.mark.parametrize("name", ["decode", "prefill_shared_cos", "gqa1"])
def test_rope_kernel_equals_the_families_function(checked, name):
    """transformers' Qwen3 apply_rotary_pos_emb against the kernel, bf16, bit for bit (the kernel
    rounds each product and the sum where the eager ops do): the decode step's shape (one
    position per row), a prefill's with cos shared by the rows, one key-value head. The outputs
    keep the inputs' layout (a transposed view's strides)."""
    got = checked["rope"][name]
    assert got["equal"] and got["strides_kept"], got


def test_rope_dispatch_runs_the_kernel_only_while_active(checked):
    """The dispatcher goes into the modeling module of the model's attention class (Qwen3's; and
    Llama's only once a Llama model is given; a decorated forward's too); inactive it is the
    function itself, active it runs the kernel once per call (and gives the function's output);
    fp16 and fp32 stay eager; a family whose function rotates interleaved pairs, or computes in
    fp32 and rounds once, is refused by the probe, which asks for equality."""
    got = checked["rope"]["dispatch"]
    assert got["modules"] == ["transformers.models.qwen3.modeling_qwen3"] and got["qwen3_dispatching"], got
    assert got["llama_untouched_before"] and got["llama_modules"] == ["transformers.models.llama.modeling_llama"], got
    assert got["usable"] and got["llama_usable"], got
    assert got["kernel_calls_inactive"] == 0 and got["kernel_calls_active"] == 1, got
    assert got["inactive_is_own"] and got["active_is_own"], got
    assert not got["fp16_usable"] and not got["fp32_usable"] and got["fp16_is_own"], got
    assert got["upcast_modules"] == ["upcast_rotary_family"] and got["upcast_refused"], got
    assert got["interleaved_modules"] == ["interleaved_rotary_family"] and got["interleaved_refused"], got
    assert got["decorated_modules"] == ["decorated_rotary_family"] and got["decorated_usable"], got


def test_decoder_runs_the_rotary_and_cache_write_kernels_and_keeps_its_tokens(checked):
    """A bf16 Qwen3 decoder with its layers' kernels: the rotary kernel, the cache writes and the
    stacked q/k/v GEMM run in its prefills and decode steps, and its greedy tokens are those of
    the same decoder with the three as transformers runs them (both kernels are exact); a slot
    without a sequence attends to the one position it is parked at."""
    got = checked["decoder_kernels"]
    assert got["equal"] and got["tokens"] == 4 * 4, got  # 4 prompts, 4 new tokens each
    assert got["calls"]["fused"]["rope"] > 0 and got["calls"]["fused"]["writes"] > 0, got
    assert got["calls"]["fused"]["stacked"] > 0, got  # the q/k/v projections as one GEMM
    eager = got["calls"]["eager"]
    assert {k: eager[k] for k in ("rope", "writes", "stacked")} == {"rope": 0, "writes": 0, "stacked": 0}, got
    for calls in got["calls"].values():  # a slot left idle once the prompts ran out reads one position
        assert calls["parked_reads"] > 0 and calls["parked_wider"] == 0 and calls["whole_cache_idle"] == 0, got


def test_top_p_floor_keeps_what_the_sorted_cut_keeps(checked):
    """The top-p floor against the sorted cut: the same tokens (bf16's ties kept or cut whole by
    both; a row -inf past the kernel's first block), but where the sums' rounding near top_p
    moves the cut by a few tail tokens, whose probability is within a float's rounding of the
    whole; and -0.0 tied with 0.0."""
    cases = dict(checked["top_p"])
    assert cases.pop("signed_zero")["kept"] == [[True, True, True, False]]  # -0.0 and 0.0: one value
    for name, got in cases.items():
        assert got["differ"] <= 8 and got["differ_mass"] < 1e-5, (name, got)
    assert sum(got["differ"] for got in cases.values()) <= 16, cases


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_slot_write_kernel_puts_what_the_eager_put_puts(checked, dtype):
    got = checked["slot_write"][dtype]
    assert got["written"] and got["outside_untouched"], got


@pytest.mark.parametrize("model", ["decoder", "decoder_one_kind"])
def test_decoder_with_the_kernel_equals_without_and_generate(checked, model):
    """Qwen3 with full and sliding layers (a dict of ranges), Llama with one layer kind (the
    ranges as its one mask, through transformers' mask builder); the kernel path with the norms
    and the cache writes through their kernels too (the rotary kernel takes bf16, not these fp32
    models: the checks above)."""
    got = checked[model]
    assert got["equal"] and got["equals_generate"], got
    assert got["tokens"] == sum(6 + k for k in range(5))  # NEW_TOKENS + k for each of the 5 prompts


def test_ranges_follow_the_masks_rule():
    positions = torch.tensor([0, 3, 9, 10])
    full = decode_ranges(positions, None)
    assert full.dtype == torch.int32 and full.shape == (4, 1, 1, 2) and is_ranges(full)
    assert full.view(4, 2).tolist() == [[0, 1], [0, 4], [0, 10], [0, 11]]
    # a window of 4: the keys at positions > position - 4, the position's own included
    assert decode_ranges(positions, 4).view(4, 2).tolist() == [[0, 1], [0, 4], [6, 10], [7, 11]]
    # a slot parked at 10 (no sequence) sees the one key it writes, in either kind of layer
    assert decode_ranges(positions, None, 10).view(4, 2).tolist() == [[0, 1], [0, 4], [0, 10], [10, 11]]
    assert decode_ranges(positions, 4, 10).view(4, 2).tolist() == [[0, 1], [0, 4], [6, 10], [10, 11]]
    assert not is_ranges(torch.zeros(4, 1, 1, 11, dtype=torch.bfloat16))
    assert not is_ranges(torch.ones(4, 1, 1, 11, dtype=torch.bool))


def test_kernel_only_where_it_can_run():
    assert not kernel_available(torch.device("cpu"), torch.bfloat16)
    assert not kernel_available(torch.device("cuda"), torch.float64)


def test_split_count():
    from dflash_core.kernels.decode_attention import MIN_SPLIT, split_count

    cpu = torch.device("cpu")
    assert split_count(512, 8, 1024, cpu) == 1  # thousands of programs already
    few = split_count(2, 8, 4096, cpu)
    assert 1 < few <= 4096 // MIN_SPLIT
    assert split_count(1, 1, 100, cpu) == 1  # too short to split


def test_sampling_kernel_draws_the_tokens_of_the_torch_ops(checked):
    """The sampling kernel through Triton's interpreter: the tokens of the noise, sum and argmax
    as torch ops, for fp32 and bf16 logits, one block and several, -inf entries and a row with
    nothing left; and the decoder's sampled tokens unchanged by it, whole, top-k then top-p,
    top-p alone (the floor against the sorted cut) and a top-k past the picked ones."""
    for name, got in checked["sampler"].items():
        assert got["equal"], (name, got)
    assert checked["decoder_sampler"]["default_on"]
    for mode in ("sample", "top-20", "top-p", "filtered"):
        got = checked["decoder_sampler"][mode]
        assert got["equal"] and got["kernel_calls"] > 0 and got["eager_calls"] == 0, (mode, got)
        assert (got["floor_calls"] > 0) == (mode == "top-p"), (mode, got)  # the floor in top-p alone


@pytest.mark.parametrize(
    "name", ["bfloat16_splitsNone_windowNone", "float32_splits3_windowNone", "float32_splits1_window9"]
)
def test_kernel_reads_the_cache_row_each_query_names(checked, name):
    """Ranges of three columns (lo, hi, row): several queries at different positions of one
    sequence's cache, as a chunked prefill's prompt tokens ride beside the decode queries; the
    same output as the two-column ranges over the rows gathered, bit for bit, and the float64
    reference's within the dtype's rounding."""
    got = checked["rows"][name]
    assert got["equals_gathered"], got
    assert got["rel"] < (1e-5 if name.startswith("float32") else 1e-2), got


def test_decoder_with_prompts_riding_in_the_kernel_step(checked):
    """The decoder of the test above, its first four prompts, the fourth riding in the decode
    steps once the first ends (4 tokens a step, over four steps, past the sliding window), on the
    kernel path (the attention reading each query's slot from its range, the cache writes naming
    each row's slot): transformers' tokens, and it rode (the masked path's riding is in
    tests/test_generate.py)."""
    got = checked["decoder_riding"]
    assert got["equals_generate"], got
    assert got["tokens"] == sum(6 + k for k in range(4)), got
    assert got["rode"][0] > 0, got
