"""FP8 settings and the FP8 GEMMs on the CPU: bad input stops the daemon's config or the engine
build at its start, naming the setting; the FP8 linear and lm_head math (torch's CPU
`_scaled_mm`, the loss kernel through Triton's interpreter) against bf16/fp32 within FP8's error.
The GPU step itself: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from dflash_core.engine import Engine, EngineConfig
from dflash_core.engine.config import step_plan
from dflash_core.fp8 import (
    Fp8Linear,
    check_fp8_shapes,
    fp8_device_problem,
    fp8_products,
    linear_products,
    quantize_head,
    use_fp8_linears,
)
from service.config import ConfigError, load_config
from tests.helpers import tiny_drafter_config, write_fp8_checkpoint, write_tiny_qwen3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


# ---------------------------------------------------------------------------- settings


def test_precision_settings_parse_from_the_daemon_config(tmp_path):
    path = tmp_path / "dflash.toml"
    path.write_text('[engine]\nprecision = "fp8"\ntarget_precision = "fp8"\n')
    cfg = load_config(path, env={})
    assert cfg.engine.precision == "fp8" and cfg.engine.target_precision == "fp8"
    default = EngineConfig()
    assert default.precision == "bf16" and default.target_precision == "as_loaded"


@pytest.mark.parametrize(
    "line, field",
    [('precision = "fp16"', "engine.precision"), ('target_precision = "int4"', "engine.target_precision")],
)
def test_unknown_precisions_are_refused_naming_the_setting(tmp_path, line, field):
    path = tmp_path / "dflash.toml"
    path.write_text(f"[engine]\n{line}\n")
    with pytest.raises(ConfigError, match=field):
        load_config(path, env={})


def test_fp8_with_debug_eager_is_refused():
    with pytest.raises(ValidationError, match="precision"):
        EngineConfig(precision="fp8", debug_eager=True)


def test_fp8_on_the_cpu_stops_the_engine_build_at_its_start(tmp_path):
    """The real build on the CPU: refused before the target loads, the message naming the setting."""
    cfg = EngineConfig(precision="fp8", target_devices=["cpu"], drafter_devices=["cpu"])
    engine = Engine(cfg, tmp_path / "data")
    with pytest.raises(ValueError, match=r'precision = "fp8": cpu is not a GPU'):
        engine.build()
    assert engine.parts is None


def test_fp8_target_on_the_cpu_stops_the_engine_build_at_its_start(tmp_path):
    cfg = EngineConfig(target_precision="fp8", target_devices=["cpu"], drafter_devices=["cpu"])
    with pytest.raises(ValueError, match=r'target_precision = "fp8": cpu is not a GPU'):
        Engine(cfg, tmp_path / "data").build()


def test_a_gpu_without_fp8_matmuls_is_named():
    caps = {"cuda:0": (9, 0), "cuda:1": (8, 0)}
    assert fp8_device_problem(["cuda:0"], caps.__getitem__) is None
    why = fp8_device_problem(["cuda:0", "cuda:1"], caps.__getitem__)
    assert why is not None and "cuda:1" in why and "8.0" in why and "8.9" in why
    with pytest.raises(ValueError, match="precision"):
        step_plan(["cpu"], precision="fp8")
    assert step_plan(["cpu"]).precision == "bf16"


def test_gemm_dimensions_fp8_cannot_take_are_named():
    good = tiny_drafter_config(hidden=64, heads=4, block_size=8)
    check_fp8_shapes(good, seq_len=512, num_anchors=32, block_size=8)
    odd = replace(good, hidden_size=72, intermediate_size=144)
    with pytest.raises(ValueError, match=r"hidden_size = 72"):
        check_fp8_shapes(odd, seq_len=512, num_anchors=32, block_size=8)
    with pytest.raises(ValueError, match=r"num_anchors \* drafted tokens = 70"):
        check_fp8_shapes(good, seq_len=512, num_anchors=10, block_size=8)  # 80 block tokens, 70 loss rows
    # anchor_first: every slot drafts, so the loss has a row per block token
    check_fp8_shapes(replace(good, layout="anchor_first"), seq_len=512, num_anchors=10, block_size=8)


# ---------------------------------------------------------------------------- the math


def test_fp8_linear_is_close_to_the_exact_linear():
    """Forward and both gradients within FP8's error (e4m3: 3 mantissa bits, a few % per GEMM)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(48, 64, generator=g) * 0.02).bfloat16().requires_grad_()
    (y,) = fp8_products((x,), (w,), ((0, 0),))
    grad = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(grad)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (x32 @ w32.t()).backward(grad.float())
    assert y.dtype == torch.bfloat16 and y.shape == (4, 32, 48)
    assert _rel(y, x32 @ w32.t()) < 0.06
    assert _rel(x.grad, x32.grad) < 0.06 and _rel(w.grad, w32.grad) < 0.06
    assert w.grad.dtype == torch.bfloat16


def test_linear_products_cast_once_and_equal_the_linears_one_by_one():
    """The drafter's q, k, v over two inputs as one FP8 group (each input and weight cast once):
    the outputs are the per-linear FP8 calls' bit for bit (the same casts and GEMMs); the
    gradients the same sums in another order. In bf16 the group is the plain calls."""
    g = torch.Generator().manual_seed(1)
    block = torch.randn(1, 32, 64, generator=g).bfloat16()
    context = torch.randn(1, 48, 64, generator=g).bfloat16()
    q, k, v = (torch.nn.Linear(64, n, bias=False).bfloat16() for n in (64, 32, 32))
    products = ((q, 0), (k, 1), (k, 0), (v, 1), (v, 0))  # k and v: two inputs each

    def run(grouped: bool):
        xs = [t.detach().clone().requires_grad_() for t in (block, context)]
        for lin in (q, k, v):
            lin.weight.grad = None
        outs = linear_products(xs, products) if grouped else [lin(xs[i]) for lin, i in products]
        sum((o.float() * (n + 1)).sum() for n, o in enumerate(outs)).backward()
        return outs, [x.grad for x in xs] + [lin.weight.grad.clone() for lin in (q, k, v)]

    plain_outs, plain_grads = run(grouped=False)
    grouped_outs, grouped_grads = run(grouped=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_outs, grouped_outs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grouped_grads, strict=True))
    use_fp8_linears(torch.nn.ModuleList([q, k, v]))
    fp8_outs, fp8_grads = run(grouped=False)  # every linear its own casts
    shared_outs, shared_grads = run(grouped=True)
    assert all(torch.equal(a, b) for a, b in zip(fp8_outs, shared_outs, strict=True))
    assert all(_rel(a, b) < 1e-2 for a, b in zip(fp8_grads, shared_grads, strict=True))
    assert all(_rel(a, b) < 0.06 for a, b in zip(shared_outs, plain_outs, strict=True))  # FP8's error
    with torch.no_grad():  # no gradients: the bf16 GEMMs, as Fp8Linear falls back
        assert all(
            torch.equal(a, b) for a, b in zip(linear_products((block, context), products), plain_outs, strict=True)
        )


def test_fp8_products_sum_a_shared_weights_gradient():
    """A weight in two products is one operand: its gradient sums both products' parts."""
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(16, 32, generator=g).bfloat16().requires_grad_() for _ in range(2))
    w = (torch.randn(16, 32, generator=g) * 0.05).bfloat16().requires_grad_()
    ya, yb = fp8_products((a, b), (w,), ((0, 0), (1, 0)))
    (ya.float().sum() + yb.float().sum()).backward()
    exact = (a.detach().float() + b.detach().float()).sum(0, keepdim=True).expand(16, 32)
    assert _rel(w.grad, exact) < 0.06 and w.grad.dtype == torch.bfloat16


def test_fp8_products_compile_as_one_operator_with_the_eager_gradients():
    """Under torch.compile the FP8 group is one opaque operator in dynamo's graph, not a custom
    autograd Function for dynamo to speculate (its forward and backward traced in Python at every
    trace of the layer); traced through AOTAutograd, the forward and both gradients are the eager
    ones bit for bit (the same casts and GEMMs), an fp32 master weight's gradient in fp32."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    g = torch.Generator().manual_seed(3)
    block = torch.randn(2, 16, 64, generator=g).bfloat16()
    context = torch.randn(2, 32, 64, generator=g).bfloat16()
    q = (torch.randn(64, 64, generator=g) * 0.05).bfloat16()
    k = torch.randn(32, 64, generator=g) * 0.05  # fp32, as a master weight

    def group(x, c, wq, wk):
        outs = fp8_products((x, c), (wq, wk), ((0, 0), (1, 1), (0, 1)))
        return sum((o.float() * (n + 1)).sum() for n, o in enumerate(outs))

    targets: list[str] = []

    def record(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (block, context, q, k)]
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    eager = run(group)
    torch._dynamo.reset()
    run(torch.compile(group, backend=record))
    assert any(t.startswith("dflash.fp8_products") for t in targets)
    assert not any("autograd_function_apply" in t for t in targets)
    torch._dynamo.reset()
    as_traced = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=lambda gm, _: make_boxed_func(gm)
    )
    traced = run(torch.compile(group, backend=as_traced))
    assert all(torch.equal(a, b) for a, b in zip(eager, traced, strict=True))
    assert eager[4].dtype == torch.float32 and eager[3].dtype == torch.bfloat16


def test_fp8_linears_keep_parameters_and_fall_back_without_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 16, bias=True)).bfloat16()
    params = list(model.parameters())
    assert use_fp8_linears(model) == 1  # the biased one stays an nn.Linear
    assert type(model[0]) is Fp8Linear and type(model[1]) is torch.nn.Linear
    assert list(model.parameters()) == params and set(model.state_dict()) == {"0.weight", "1.weight", "1.bias"}
    x = torch.randn(16, 64).bfloat16()
    with torch.no_grad():  # evaluation: the bf16 GEMM, bit for bit
        assert torch.equal(model[0](x), torch.nn.functional.linear(x, model[0].weight))
    x7 = torch.randn(7, 64).bfloat16().requires_grad_()  # 7 rows: FP8 cannot take them
    assert torch.equal(model[0](x7), torch.nn.functional.linear(x7, model[0].weight))
    assert not torch.equal(model[0](x.requires_grad_()), torch.nn.functional.linear(x, model[0].weight))


def test_fp8_head_pads_the_vocabulary_with_zero_rows():
    w = torch.randn(1003, 64).bfloat16()
    head = quantize_head(w)
    assert head.vocab == 1003 and head.rows.shape == (1008, 64) and head.cols.shape == (64, 1008)
    assert head.rows.dtype == torch.float8_e4m3fn and not head.rows[1003:].float().any()
    assert torch.equal(head.cols, head.rows.t())
    assert _rel(head.rows[:1003].float() * head.inv_scale, w) < 0.05


@pytest.mark.slow  # the Triton kernel in the (slow) interpreter
@pytest.mark.interpreted_check("tests.ce_check", "--fp8")
def test_fp8_loss_chunk_matches_the_exact_chunk_interpreted(interpreted):
    """The FP8 lm_head loss chunk (kernels/ce.py, Triton's interpreter) against the fp32 eager
    chunk: loss within 0.5 %, the hidden-state gradient within FP8's error, hits the same but
    where FP8's rounding reorders near-tied top logits (at most 1 in 6 of these random rows)."""
    result = interpreted("tests.ce_check", "--fp8")
    assert result["loss_rel"] < 5e-3 and result["grad_rel"] < 0.06, result
    assert result["hit_mismatches"] <= result["rows"] // 6, result
    assert result["padded_vocab"] > result["vocab"]


def test_fp8_target_captures_features_close_to_the_loaded_ones(assets_dir):
    """target_precision = "fp8" on the embedded target (CPU _scaled_mm; the engine refuses FP8 on
    a CPU, the math is the same): every decoder linear replaced, its bf16 weight gone; features
    within FP8's error of the loaded target's, not equal to them (they are the FP8 target's)."""
    from dflash_core.defaults import DEFAULT_TARGET_LAYER_IDS
    from dflash_core.target import TargetModel
    from dflash_core.target_precision import Fp8FrozenLinear

    path = Path(assets_dir) / "target"
    ids = list(DEFAULT_TARGET_LAYER_IDS)
    plain, fp8 = (TargetModel(path, ids, "cpu", fp8=q) for q in (False, True))
    layers = fp8.decoder_layers()
    converted = [m for m in layers.modules() if isinstance(m, Fp8FrozenLinear)]
    assert len(converted) == 7 * len(layers) and not any(type(m) is torch.nn.Linear for m in layers.modules())
    ids_ = torch.randint(5, fp8.config.vocab_size, (37,))  # 37 rows: padded to 48 for the GEMMs, cut back
    pos, doc = torch.arange(37), torch.zeros(37, dtype=torch.long)
    a, b = plain.capture(ids_, pos, doc), fp8.capture(ids_, pos, doc)
    assert a.shape == b.shape and not torch.equal(a, b)
    assert _rel(b, a) < 0.1


def test_an_fp8_checkpoint_runs_as_it_is_served(tmp_path):
    """A fine-grained FP8 checkpoint (written here from a tiny bf16 Qwen3) loads with its weights
    as stored (FP8 values times block scales, exactly) and its linears casting activations per
    token and 128 columns, as served; its features are the FP8 target's (close to the bf16
    target's, not equal). target_precision fp8 leaves it as stored."""
    from dflash_core.target import TargetModel
    from dflash_core.target_precision import ActQuantLinear, dequantize_blocks, fake_quantize_groups

    write_tiny_qwen3(tmp_path / "bf16")
    write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    plain = TargetModel(tmp_path / "bf16", [1, 2], "cpu")
    served = TargetModel(tmp_path / "fp8", [1, 2], "cpu", fp8=True)
    assert served.stored_fp8 and not plain.stored_fp8
    layers = served.decoder_layers()
    linears = [m for m in layers.modules() if isinstance(m, ActQuantLinear)]
    assert len(linears) == 7 * len(layers)
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    q = layers[0].self_attn.q_proj
    expected = dequantize_blocks(
        stored["model.layers.0.self_attn.q_proj.weight"], stored["model.layers.0.self_attn.q_proj.weight_scale_inv"], torch.float32, (128, 128)
    )  # fmt: skip
    assert torch.equal(q.linear.weight, expected)
    x = torch.randn(5, 128)
    assert torch.equal(q(x), torch.nn.functional.linear(fake_quantize_groups(x, 128), expected))
    assert torch.equal(served.model.lm_head.weight, served.model.model.embed_tokens.weight)  # tied, as stored
    ids = torch.randint(5, 512, (40,))
    pos, doc = torch.arange(40), torch.zeros(40, dtype=torch.long)
    a, b = plain.capture(ids, pos, doc), served.capture(ids, pos, doc)
    assert not torch.equal(a, b) and _rel(b, a) < 0.1


def test_linears_fed_the_same_tensor_share_one_cast():
    """The FP8 target's linears share an activation cast only for the same tensor at the same
    version: q, k and v reuse q's, a tensor modified in place or another tensor is cast anew, and
    every output equals the output of a cast of its own."""
    from dflash_core.target_precision import Fp8FrozenLinear, InputCasts

    torch.manual_seed(0)
    shared, alone = InputCasts(), InputCasts()
    linears = [torch.nn.Linear(64, n, bias=False) for n in (64, 32, 32)]
    fp8 = [Fp8FrozenLinear(m, shared) for m in linears]
    own = [Fp8FrozenLinear(m, alone) for m in linears]
    x = torch.randn(2, 21, 64, dtype=torch.bfloat16)
    first = shared.cast(x, 64)
    assert shared.cast(x, 64) is first  # reused: the same tensor, unmodified
    for a, b in zip(fp8, own, strict=True):
        alone.clear()
        assert torch.equal(a(x), b(x))
    assert first[0].shape == (48, 64) and first[2] == 42  # 42 rows padded to 48
    x.mul_(2)  # in place: a new version, a new cast
    assert shared.cast(x, 64) is not first
    y = x.clone()
    assert shared.cast(y, 64) is not shared.cast(x, 64)
    shared.clear()
    assert shared._local.entry is None


@pytest.mark.interpreted_check("tests.fp8_cast_check")
def test_fp8_cast_kernel_interpreted(interpreted):
    """kernels/fp8_cast.py through Triton's interpreter: the inverse scale equal to
    fp8.quantize's, the appended rows zero, every value within the format's range; a NaN or an
    infinity makes the inverse scale infinite. (The interpreter's own FP8 rounding is not the
    GPU's; tests/gpu compares the values bit for bit.)"""
    result = interpreted("tests.fp8_cast_check")
    assert result["inv_equal"] and result["pad_zero"] and result["in_range"] and result["shape_ok"], result
    nonfinite = result["nonfinite"]
    assert nonfinite["nan_inv_inf"] and nonfinite["inf_inv_inf"], nonfinite  # the GEMM's output: NaN


def test_an_engine_job_trains_on_an_fp8_checkpoint(tmp_path):
    """The embedded default target stored as fine-grained FP8 trains a drafter (on the CPU it
    runs with the serving numerics like anywhere else): the job succeeds with a finite loss, and
    the engine's target is the FP8 one."""
    from dflash_core.defaults import ensure_default_assets
    from dflash_core.engine import JobCallbacks
    from tests.helpers import assets_job, build_engine, small_engine_config

    assets = ensure_default_assets(tmp_path / "data")
    cfg = small_engine_config(target_path=write_fp8_checkpoint(assets.target, tmp_path / "target_fp8"))
    engine = build_engine(cfg, assets)
    assert engine.parts is not None and engine.parts.targets[0].stored_fp8
    losses = []

    class CB(JobCallbacks):
        def on_step(self, s):
            losses.append(s.loss)

    res = engine.run_job(assets_job(assets, tmp_path / "out", 3), CB())
    engine.close()
    assert res.status == "SUCCEEDED" and len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_block_scales_follow_the_checkpoints_block_size_with_partial_edge_blocks():
    """A [200, 384] FP8 weight with 128 x 128 blocks has 2 x 3 scales, the last row of blocks 72
    rows tall: rows 0-127 take the first row of scales, 128-199 the second (not a block size
    guessed from the shapes, which would split the rows 100 / 100); a scale grid of another
    shape is refused."""
    from dflash_core.target_precision import dequantize_blocks

    ones = torch.ones(200, 384).to(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    w = dequantize_blocks(ones, scales, torch.float32, (128, 128))
    assert w[127, 0] == 1 and w[128, 0] == 4 and w[199, 383] == 6 and w[0, 256] == 3 and w[150, 200] == 5
    with pytest.raises(ValueError, match=r"needs scales \[2, 3\]"):
        dequantize_blocks(ones, scales[:, :2], torch.float32, (128, 128))


def _fp8_variant(tmp_path, name: str, edit) -> Path:
    """The tiny FP8 checkpoint with edit(tensors, config) applied to what it stores."""
    from safetensors.torch import load_file, save_file

    base = tmp_path / "fp8"
    if not base.exists():
        write_tiny_qwen3(tmp_path / "bf16")
        write_fp8_checkpoint(tmp_path / "bf16", base)
    out = tmp_path / name
    shutil.copytree(base, out)
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


Q = "model.layers.0.self_attn.q_proj.weight"


def _set(key, value_of):
    def edit(tensors, config):
        value = value_of(tensors)
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value

    return edit


def _block(value):
    def edit(tensors, config):
        config["quantization_config"]["weight_block_size"] = value

    return edit


@pytest.mark.parametrize(
    "edit, tensor, why",
    [
        (_set(Q + "_scale_inv", lambda t: t[Q + "_scale_inv"].to(torch.int32)), Q, "floating point"),
        (_set(Q, lambda t: t[Q].view(torch.int8)), Q, "must be float8_e4m3fn"),
        (_set(Q, lambda t: t[Q].float().to(torch.float8_e5m2)), Q, "must be float8_e4m3fn"),
        (_set(Q + "_scale_inv", lambda t: None), Q, "without block scales"),
        (_set(Q + "_scale_inv", lambda t: torch.full_like(t[Q + "_scale_inv"], float("nan"))), Q, "NaN"),
        (_set(Q + "_scale_inv", lambda t: torch.zeros_like(t[Q + "_scale_inv"])), Q, "positive"),
        (_set(Q + "_scale_inv", lambda t: t[Q + "_scale_inv"].repeat(2, 1)), Q, "needs scales"),
        (_block([0, 0]), "weight_block_size", "two positive integers"),
        (_block([128]), "weight_block_size", "two positive integers"),
    ],
    ids=[
        "int-scales",
        "int8-weight",
        "e5m2-weight",
        "no-scales",
        "nan-scales",
        "zero-scales",
        "grid",
        "block-0",
        "block-1",
    ],
)
def test_a_corrupt_fp8_checkpoint_is_refused_naming_file_and_tensor(tmp_path, edit, tensor, why):
    from dflash_core.target import TargetModel

    target = _fp8_variant(tmp_path, "bad", edit)
    with pytest.raises(ValueError) as e:
        TargetModel(target, [1, 2], "cpu")
    message = str(e.value)
    assert tensor in message and why in message, message
    assert "config.json" in message if tensor == "weight_block_size" else "model.safetensors" in message


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_an_unreadable_safetensors_file_is_named(tmp_path, damage):
    """A truncated shard or a corrupt header, of a plain or an FP8 target: the error names the file."""
    from dflash_core.target import TargetModel

    write_tiny_qwen3(tmp_path / "bf16")
    write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    for target in (tmp_path / "bf16", tmp_path / "fp8"):
        file = target / "model.safetensors"
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2] if damage == "truncated" else data[:8] + b"{garbage" + data[16:])
        with pytest.raises(ValueError) as e:
            TargetModel(target, [1, 2], "cpu")
        assert str(file) in str(e.value) and "not a readable safetensors file" in str(e.value), e.value


def test_fp8_weights_in_a_target_without_fp8_quantization_are_refused(tmp_path):
    """A checkpoint whose config.json declares no FP8 quantization but that stores an e4m3 weight
    would load its raw codes as weights: refused, naming the file and the tensor."""
    from safetensors.torch import load_file, save_file

    from dflash_core.target import TargetModel

    target = write_tiny_qwen3(tmp_path / "bf16")
    tensors = load_file(str(target / "model.safetensors"))
    tensors[Q] = tensors[Q].float().to(torch.float8_e4m3fn)
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        TargetModel(target, [1, 2], "cpu")
    assert "model.safetensors" in str(e.value) and Q in str(e.value) and "F8_E4M3" in str(e.value), e.value
