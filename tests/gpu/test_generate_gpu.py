"""The slot decoder on CUDA (marker gpu; skipped without CUDA): the recorded decode step gives the
tokens of the eager step and of transformers' greedy generate on the embedded target (fp32), for
prompts of different lengths with slots refilled; seeded sampling equal with and without the graph;
reserved memory flat over a second run; the decode-attention kernel against a float64 reference,
and the recorded step with it equal to the step without it; the RMSNorm kernel against the norm
classes, and the decoder's default (norms through it) equal to generate; the rotary and
cache-write kernels bit for bit against the eager code, and a bf16 decoder's tokens unchanged by them;
the stacked q/k/v GEMM against the three, and the tokens with it; the sampling kernel's tokens
those of the torch ops it replaces, alone and in the recorded step; prompts riding in the
recorded step at two widths (fp32 against generate, bf16 and FP8 against the eager step), and
the narrower riding graphs in the widest one's memory."""

import pytest
import torch

from tests.helpers import heldout_prompt_ids

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def setup(default_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_assets.target))
    model = AutoModelForCausalLM.from_pretrained(
        str(default_assets.target), dtype=torch.float32, attn_implementation="sdpa"
    )
    model = model.eval().to("cuda")
    return model, heldout_prompt_ids(default_assets.heldout, tok, 9)


def _run(model, prompts, sampling, use_graph, slots=4, attention_kernel=None, configure=None, ride_rows=0, limits=None):
    """The decoder's completions of `prompts` (32 new tokens each, or limits[k]), and the decoder."""
    from dflash_core.regenerate.decode import Request, SlotDecoder

    dec = SlotDecoder(
        model, slots=slots, length=192, use_graph=use_graph, attention_kernel=attention_kernel, ride_rows=ride_rows
    )
    if configure is not None:
        configure(dec)
    assert dec.use_graph == use_graph
    limits = limits or [32] * len(prompts)
    requests = [Request(k, p, limits[k], seed=k) for k, p in enumerate(prompts)]
    done = {c.key: c.tokens for c in dec.generate(requests, sampling)}
    return done, dec


def test_graph_equals_eager_and_generate(setup):
    from dflash_core.regenerate.decode import Sampling

    model, prompts = setup
    eos = model.generation_config.eos_token_id
    greedy = Sampling(stop_token_ids=(eos,))
    graph, dec = _run(model, prompts, greedy, True)
    assert dec.norms is not None  # the default on CUDA: generate below runs the norms' own forwards
    eager, _ = _run(model, prompts, greedy, False)
    assert graph == eager
    _equals_generate_then_again_flat(model, prompts, dec, graph, greedy)


def _equals_generate_then_again_flat(model, prompts, dec, tokens, greedy):
    """`tokens` (dec's greedy run) are those of transformers' generate, and a second run of dec
    gives them again without growing the reserved memory."""
    from dflash_core.regenerate.decode import Request

    for k, ids in enumerate(prompts):
        with torch.no_grad():
            full = model.generate(
                torch.tensor([ids], device="cuda"), do_sample=False, max_new_tokens=32, pad_token_id=0
            )
        assert tokens[k] == full[0, len(ids) :].tolist(), k
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    requests = [Request(k, p, 32, seed=k) for k, p in enumerate(prompts)]
    again = {c.key: c.tokens for c in dec.generate(requests, greedy)}
    torch.cuda.synchronize()
    assert again == tokens
    assert torch.cuda.memory_reserved() == reserved


def test_recorded_riding_step_equals_eager_and_generate(setup):
    """Refilled prompts riding in the recorded decode step (a graph per width, up to 24 prompt
    tokens a step beside 4 slots, 6 in the narrow one: the kernel reading each query's slot from
    its range, the cache writes naming each row's slot): generate's greedy tokens, and reserved
    memory flat over a second run; then the same decoder sampled (its graphs recorded into the
    same pool) gives the eager decoder's tokens, and greedy again its first tokens."""
    from dflash_core.regenerate.decode import Request, Sampling

    model, prompts = setup
    eos = model.generation_config.eos_token_id
    greedy = Sampling(stop_token_ids=(eos,))
    graph, dec = _run(model, prompts, greedy, True, ride_rows=24)
    assert dec.attention_kernel and dec.ride_widths == (24, 6)
    assert 0 < dec.riding_steps < dec.decode_steps, (dec.riding_steps, dec.decode_steps)
    _equals_generate_then_again_flat(model, prompts, dec, graph, greedy)
    # a second sampling mode recorded later into the same graph pool, then the first mode again
    sampling = Sampling(temperature=0.8, top_p=0.9, stop_token_ids=(eos,))
    requests = [Request(k, p, 32, seed=k) for k, p in enumerate(prompts)]
    recorded = {c.key: c.tokens for c in dec.generate(requests, sampling)}
    assert (sampling.mode, 24) in dec._graphs
    eager, _ = _run(model, prompts, sampling, False, slots=3)
    assert recorded == eager
    assert {c.key: c.tokens for c in dec.generate(requests, greedy)} == graph


def test_sampled_graph_equals_eager(setup):
    from dflash_core.regenerate.decode import Sampling

    model, prompts = setup
    eos = model.generation_config.eos_token_id
    sampling = Sampling(temperature=0.8, top_p=0.9, top_k=50, stop_token_ids=(eos,))
    graph, _ = _run(model, prompts, sampling, True, slots=3)
    eager, _ = _run(model, prompts, sampling, False, slots=5)
    assert graph == eager


def test_decode_attention_kernel_on_cuda():
    """The cases the CPU runs through Triton's interpreter, compiled (bf16 tensor-core dots)."""
    from tests.decode_attention_check import kernel_cases

    for name, got in kernel_cases("cuda").items():
        tol = 1e-5 if name.startswith("fp32") else 1e-2
        assert got["finite"] and got["dtype_kept"] and got["rel"] < tol and got["vs_masked"] < 2 * tol, (name, got)


def test_norm_kernel_on_cuda():
    """The CPU's interpreted norm cases, compiled."""
    from tests.decode_attention_check import norm_cases

    for name, got in norm_cases("cuda").items():
        if name.startswith("slice_"):  # heads read in place from a wider row: the copy's bits
            assert got["strided"] and got["equal"], (name, got)
            continue
        assert got["weighting"] == ("offset" if name.startswith("Gemma3") else "scaled"), (name, got)
        assert got["dtype_kept"] and got["rel"] < (1e-5 if "float32" in name else 2e-2), (name, got)


def test_rope_and_slot_write_kernels_on_cuda():
    """The CPU's interpreted rotary and cache-write cases, compiled: bit for bit there too."""
    from tests.decode_attention_check import rope_cases, slot_write_cases

    got = rope_cases("cuda")
    dispatch = got.pop("dispatch")
    for name, case in got.items():
        assert case["equal"] and case["strides_kept"], (name, case)
    assert dispatch["usable"] and not dispatch["fp16_usable"] and dispatch["upcast_refused"], dispatch
    assert dispatch["kernel_calls_active"] == 1 and dispatch["active_is_own"], dispatch
    assert dispatch["inactive_is_own"] and dispatch["interleaved_refused"], dispatch
    for dtype, case in slot_write_cases("cuda").items():
        assert case["written"] and case["outside_untouched"], (dtype, case)


def test_sampling_kernel_on_cuda():
    """The CPU's interpreted sampling cases, compiled, against the torch ops on CUDA: the same
    tokens (the kernel's logarithm and division round as torch's CUDA ones)."""
    from tests.decode_attention_check import decoder_sampler_case, sampler_cases

    for name, got in sampler_cases("cuda").items():
        assert got["equal"], (name, got)
    decoder = decoder_sampler_case("cuda")
    assert decoder.pop("default_on")  # its probe passed
    for mode, got in decoder.items():
        assert got["equal"] and got["kernel_calls"] > 0 and got["eager_calls"] == 0, (mode, got)
        assert (got["floor_calls"] > 0) == (mode == "top-p"), (mode, got)


def test_sampled_recorded_step_with_the_kernel_equals_the_torch_ops(setup):
    """The recorded decode step samples through the kernel by default on CUDA, from the whole
    distribution, top-k then top-p, and top-p alone: the tokens of the eager step with the
    sampling as torch ops."""
    from dflash_core.regenerate.decode import Sampling

    model, prompts = setup
    eos = model.generation_config.eos_token_id
    for sampling in (
        Sampling(temperature=1.0, stop_token_ids=(eos,)),
        Sampling(temperature=0.8, top_p=0.9, top_k=50, stop_token_ids=(eos,)),
        Sampling(temperature=0.8, top_p=0.9, stop_token_ids=(eos,)),
    ):
        graph, dec = _run(model, prompts, sampling, True, slots=3)
        assert dec.sample_kernel and (sampling.mode, False) in dec._graphs
        eager, _ = _run(
            model, prompts, sampling, False, slots=5, configure=lambda d: setattr(d, "sample_kernel", False)
        )
        assert graph == eager, sampling.mode


def test_rotary_and_cache_write_kernels_change_no_token(setup):
    """A bf16 target: the decoder's default on CUDA (norms, rotary embeddings and cache writes
    through kernels), recorded, against the same decoder with the rotary embeddings and cache
    writes eager: the same greedy tokens, since those two kernels are exact."""
    import copy

    from dflash_core.regenerate.decode import Sampling

    model, prompts = setup
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    greedy = Sampling(ignore_stop=True)
    fused, dec = _run(bf16, prompts, greedy, True)
    assert dec.rope is not None and dec.cache.write_kernel and dec._graphs

    def norms_only(d):
        d.rope = None
        d.cache.write_kernel = False

    plain, other = _run(bf16, prompts, greedy, True, configure=norms_only)
    assert other.norms is not None and other.rope is None
    assert fused == plain and all(len(t) == 32 for t in fused.values())
    # and the kernels did run: the CPU check counts their calls in a bf16 decoder's steps
    from tests.decode_attention_check import decoder_kernels_case

    case = decoder_kernels_case("cuda")
    assert case["equal"] and case["calls"]["fused"]["rope"] > 0 and case["calls"]["fused"]["writes"] > 0, case


def test_stacked_qkv_gemm_keeps_each_projection_and_the_tokens(setup):
    """A bf16 target: each layer's stacked q/k/v GEMM (target_qkv.py) at a decode step's rows
    against the three GEMMs (within a bf16 rounding: cuBLAS may pick another kernel for the wider
    GEMM), and the recorded decoder's greedy tokens with it against the three GEMMs'."""
    import copy

    import torch.nn.functional as F

    from dflash_core.regenerate.decode import Sampling
    from dflash_core.target_qkv import fused_qkv

    model, prompts = setup
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    fused = fused_qkv(bf16)
    assert fused is not None and len(fused.weights) == bf16.config.num_hidden_layers
    x = torch.randn(256, 1, bf16.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    worst = 0.0
    with torch.no_grad(), fused.active():
        for layer in bf16.model.layers:
            attn = layer.self_attn
            for role, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
                got, want = proj(x), F.linear(x, proj.weight)
                # the stacked GEMM ran: the query's call kept it for the key's and the value's
                assert (fused._pending is not None) == (role < 2), role
                worst = max(worst, float((got.float() - want.float()).abs().max() / want.float().abs().max()))
    assert worst < 1e-2, worst
    greedy = Sampling(ignore_stop=True)
    stacked, dec = _run(bf16, prompts, greedy, True)
    assert dec.qkv is not None and dec._graphs
    three, _ = _run(bf16, prompts, greedy, True, configure=lambda d: setattr(d, "qkv", None))
    assert stacked == three


def test_graph_records_the_kernel_and_equals_the_masked_step(setup, monkeypatch):
    """The decoder's default on CUDA is the kernel; recorded in the graph, its greedy tokens are
    those of the eager step over masks (fp32: the kernel's dots are exact there)."""
    import dflash_core.kernels.decode_attention as kernel
    from dflash_core.regenerate.decode import Sampling

    model, prompts = setup
    calls = []
    launch = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *a, **k: calls.append(1) or launch(*a, **k))
    eos = model.generation_config.eos_token_id
    greedy = Sampling(stop_token_ids=(eos,))
    with_kernel, dec = _run(model, prompts, greedy, True)
    assert dec.attention_kernel and dec._graphs and calls  # recorded (the replays call no Python)
    recorded = len(calls)
    masked, plain = _run(model, prompts, greedy, False, attention_kernel=False)
    assert not plain.attention_kernel and len(calls) == recorded
    assert with_kernel == masked


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 matmuls"
)
def test_fp8_target_decodes_through_the_recorded_kernel_step(setup):
    """The FP8 target of regeneration (decoder linears as FP8 GEMMs, the LM head bf16): the
    recorded step with the kernel gives the eager step's greedy tokens (the same math; FP8's
    activation casts included in the graph)."""
    import copy

    from dflash_core.regenerate.decode import Sampling
    from dflash_core.target_precision import Fp8FrozenLinear, quantize_decoder_linears

    model, prompts = setup
    fp8 = copy.deepcopy(model).to(torch.bfloat16)
    assert quantize_decoder_linears(fp8.get_decoder().layers) is not None
    assert any(isinstance(m, Fp8FrozenLinear) for m in fp8.modules())
    assert fp8.get_output_embeddings().weight.dtype == torch.bfloat16
    greedy = Sampling(ignore_stop=True)
    graph, dec = _run(fp8, prompts, greedy, True)
    eager, _ = _run(fp8, prompts, greedy, False)
    assert dec.attention_kernel and dec._graphs
    assert graph == eager and all(len(t) == 32 for t in graph.values())


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_riding_in_bf16_and_fp8_targets_records_the_eager_steps(setup, precision):
    """A bf16 target, and the FP8 one (its linears pad the step's rows, slots plus a riding
    width, to their GEMM's multiple): sequences of 14 to 32 tokens, so that slots free apart, and
    every other prompt cut to 5 tokens, so that prompts ride at both widths; the recorded
    decoder's greedy tokens are the eager decoder's (the same steps, the same shapes), and a
    second run gives them again with reserved memory flat."""
    import copy

    from dflash_core.regenerate.decode import Request, Sampling
    from dflash_core.target_precision import quantize_decoder_linears

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 matmuls")
    model, prompts = setup
    prompts = [p if k % 2 == 0 else p[:5] for k, p in enumerate(prompts)]
    target = copy.deepcopy(model).to(torch.bfloat16)
    if precision == "fp8":
        assert quantize_decoder_linears(target.get_decoder().layers) is not None
    greedy = Sampling(ignore_stop=True)
    limits = [32 - 6 * (k % 4) for k in range(len(prompts))]
    graph, dec = _run(target, prompts, greedy, True, ride_rows=24, limits=limits)
    assert set(dec.width_steps) == {24, 6}, dec.width_steps
    eager, plain = _run(target, prompts, greedy, False, ride_rows=24, limits=limits)
    assert plain.width_steps == dec.width_steps
    assert graph == eager and [len(graph[k]) for k in range(len(prompts))] == limits
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    requests = [Request(k, p, limits[k], seed=k) for k, p in enumerate(prompts)]
    again = {c.key: c.tokens for c in dec.generate(requests, greedy)}
    torch.cuda.synchronize()
    assert again == graph and torch.cuda.memory_reserved() == reserved


def test_narrower_riding_graphs_take_the_widest_ones_memory():
    """The decoder's graphs share one memory pool and one capture stream: recorded after the
    widest riding step, the narrower ones and the plain step grow reserved memory by a small part
    of what the widest took (their logits and activations fit in its blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_core.regenerate.decode import Sampling, SlotDecoder

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
    )
    model = LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    dec = SlotDecoder(model, slots=64, length=1024, ride_rows=512)
    assert dec.ride_widths == (512, 128, 32, 8)
    dec._set_sampling(Sampling())

    def grown(width: int) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        with torch.no_grad():
            dec._graphs[("greedy", width)] = dec._record("greedy", width)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved() - before

    widest = grown(512)
    rest = [grown(w) for w in (128, 32, 8, 0)]
    assert widest > 0 and sum(rest) <= widest // 4, (widest, rest)
