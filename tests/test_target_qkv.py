"""The q/k/v projections as one GEMM in the regeneration decoder (target_qkv.py): which layers
take it, that a projection always returns its own product, that the decoder's tokens are those
of the three GEMMs, that a target changed in place is decoded with its new weights, and that the
compiler and other threads see the modules as they were."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

from dflash_core.module_dispatch import base_class
from dflash_core.regenerate.decode import Request, Sampling, SlotDecoder
from dflash_core.regenerate.sizing import decoder_bytes
from dflash_core.target_qkv import FusedQkv, QkvDispatch, fused_qkv
from tests.tiny_decoders import tiny_llama, tiny_qwen2, tiny_sliding_qwen3


class _OtherLinear(nn.Linear):
    """A projection of another class than nn.Linear (as an FP8 linear is): keeps its own GEMM."""


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6)]


def _decode(model, stacked: bool, prompts, sampling=None) -> dict:
    dec = SlotDecoder(model, slots=3, length=40, use_graph=False, attention_kernel=False, fused_kernels=False)
    dec.qkv = fused_qkv(model) if stacked else None
    done = dec.generate(
        [Request(k, p, 8 + k, seed=k) for k, p in enumerate(prompts)], sampling or Sampling(ignore_stop=True)
    )
    return {c.key: c.tokens for c in done}


def test_every_layer_of_plain_linears_takes_it_and_others_keep_their_gemms():
    model = tiny_sliding_qwen3()
    dispatch = QkvDispatch.of(model)
    attn = model.model.layers[0].self_attn
    assert len(dispatch.groups) == len(model.model.layers) and dispatch.groups[0] == [
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
    ]
    assert QkvDispatch.of(model) is dispatch and QkvDispatch(model).groups == []  # taken modules stay
    assert isinstance(attn.q_proj, nn.Linear) and base_class(attn.q_proj) is nn.Linear
    per_layer = sum(m.weight.numel() * 4 for m in dispatch.groups[0])
    assert dispatch.stacked_bytes() == decoder_bytes(model) == per_layer * len(model.model.layers)
    assert FusedQkv(dispatch).nbytes == dispatch.stacked_bytes()  # what a decoder then holds

    other = tiny_llama()
    layers = other.model.layers
    layers[0].self_attn.k_proj.__class__ = _OtherLinear  # not a plain linear
    layers[1].self_attn.v_proj.bias = nn.Parameter(torch.zeros(layers[1].self_attn.v_proj.out_features))  # one bias
    assert QkvDispatch.of(other).groups == []
    assert type(layers[0].self_attn.q_proj) is nn.Linear  # nothing of a skipped layer changed


def test_a_projection_returns_its_own_product_whatever_the_order_of_the_calls():
    model = tiny_sliding_qwen3()
    fused = FusedQkv(QkvDispatch.of(model))
    attn = model.model.layers[1].self_attn
    x, y = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    own = {name: nn.functional.linear(x, getattr(attn, name).weight) for name in ("q_proj", "k_proj", "v_proj")}
    with torch.no_grad(), fused.active():
        assert torch.allclose(attn.v_proj(x), own["v_proj"])  # no query call before it: its own GEMM
        assert torch.allclose(attn.q_proj(x), own["q_proj"])
        assert fused._pending is not None and fused._pending[1] is x
        assert torch.allclose(attn.k_proj(y), nn.functional.linear(y, attn.k_proj.weight))  # another input
        assert torch.allclose(attn.k_proj(x), own["k_proj"]) and torch.allclose(attn.v_proj(x), own["v_proj"])
        assert fused._pending is None  # the value's call let the stacked output go
        z = x.clone()
        attn.q_proj(z)
        z.add_(1)  # written in place between the query's call and the key's: the key's own GEMM
        assert torch.allclose(attn.k_proj(z), nn.functional.linear(z, attn.k_proj.weight))
    # off, and in another thread while on here: the module's own forward
    assert torch.equal(attn.q_proj(x), own["q_proj"])
    seen = {}
    with torch.no_grad(), fused.active():
        worker = threading.Thread(target=lambda: seen.update(q=attn.q_proj(x), pending=fused._pending))
        worker.start()
        worker.join()
    assert torch.equal(seen["q"], own["q_proj"]) and seen["pending"] is None


@pytest.mark.parametrize("build", [tiny_sliding_qwen3, tiny_llama, tiny_qwen2])
def test_the_decoder_with_one_gemm_keeps_the_tokens_and_runs_no_key_or_value_gemm(build, monkeypatch):
    model = build()
    prompts = _prompts(1)
    three = _decode(model, False, prompts)
    calls = {"own": 0}
    own_forward = nn.Linear.forward

    def counted(self, x):
        if self in QkvDispatch.of(model).groups[0]:
            calls["own"] += 1
        return own_forward(self, x)

    monkeypatch.setattr(nn.Linear, "forward", counted)
    assert _decode(model, True, prompts) == three
    assert calls["own"] == 0  # the first layer's three projections never ran their own GEMMs
    sampled = Sampling(temperature=0.8, top_p=0.9, ignore_stop=True)
    assert _decode(model, True, prompts, sampled) == _decode(model, False, prompts, sampled)


def test_a_target_changed_in_place_is_decoded_with_its_new_weights():
    """A continual job's target swap copies new weights into the parameters; the decoder built
    before it copies them into its stacked weights at its next generate."""
    model = tiny_sliding_qwen3()
    prompts = _prompts(3)
    dec = SlotDecoder(model, slots=3, length=40, use_graph=False, attention_kernel=False, fused_kernels=False)
    dec.qkv = fused_qkv(model)
    requests = [Request(k, p, 8) for k, p in enumerate(prompts)]
    before = {c.key: c.tokens for c in dec.generate(requests, Sampling(ignore_stop=True))}
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                proj = getattr(layer.self_attn, name)
                proj.weight.copy_(torch.randn_like(proj.weight) * 0.5)
    after = {c.key: c.tokens for c in dec.generate(requests, Sampling(ignore_stop=True))}
    fresh = SlotDecoder(model, slots=3, length=40, use_graph=False, attention_kernel=False, fused_kernels=False)
    fresh.qkv = None  # the three GEMMs over the parameters as they are now
    assert after == {c.key: c.tokens for c in fresh.generate(requests, Sampling(ignore_stop=True))}
    assert after != before


def test_the_compiler_traces_the_modules_own_forward():
    model = tiny_sliding_qwen3()
    fused = FusedQkv(QkvDispatch.of(model))
    layer = model.model.layers[0]
    x = torch.randn(2, 5, 64)
    compiled = torch.compile(lambda t: layer.self_attn.q_proj(t), fullgraph=True, backend="eager")
    with torch.no_grad(), fused.active():
        assert torch.equal(compiled(x), nn.functional.linear(x, layer.self_attn.q_proj.weight))
        assert fused._pending is None  # the traced call did not stack


def test_copies_and_pickles_of_the_target_carry_their_own_dispatch():
    model = tiny_sliding_qwen3()
    dispatch = QkvDispatch.of(model)
    twin = copy.deepcopy(model)
    assert QkvDispatch.of(twin) is not dispatch and len(QkvDispatch.of(twin).groups) == len(dispatch.groups)
    assert twin.model.layers[0].self_attn.q_proj.__dict__["_dflash_qkv"][0] is QkvDispatch.of(twin)
    loaded = pickle.loads(pickle.dumps(model))
    q = loaded.model.layers[0].self_attn.q_proj
    assert type(q) is nn.Linear and not any(k.startswith("_dflash_") for k in q.__dict__)
    assert len(QkvDispatch.of(loaded).groups) == len(dispatch.groups)  # installed anew
    x = torch.randint(2, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_biases_are_stacked_with_their_weights():
    model = tiny_qwen2()
    fused = FusedQkv(QkvDispatch.of(model))
    attn = model.model.layers[0].self_attn
    assert fused.biases[0] is not None and fused.nbytes == QkvDispatch.of(model).stacked_bytes()
    x = torch.randn(3, 1, 64)
    with torch.no_grad(), fused.active():
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for proj, out in zip((attn.q_proj, attn.k_proj, attn.v_proj), got):
        assert torch.allclose(out, nn.functional.linear(x, proj.weight, proj.bias), atol=1e-6)


def test_only_the_language_models_layers_are_stacked():
    """A multimodal target's vision tower never runs in the decoder: its projections keep their
    class and take no stacked memory."""

    class TwoTowers(nn.Module):
        def __init__(self):
            super().__init__()
            self.language, self.vision = tiny_llama().model, tiny_sliding_qwen3().model

        def get_decoder(self):
            return self.language

    model = TwoTowers()
    dispatch = QkvDispatch.of(model)
    assert len(dispatch.groups) == len(model.language.layers)
    assert type(model.vision.layers[0].self_attn.q_proj) is nn.Linear


def test_the_decoder_stacks_with_its_kernels_unless_told_not_to():
    model = tiny_llama()
    assert SlotDecoder(model, slots=2, length=16, use_graph=False, fused_kernels=False).qkv is None
    stacked = SlotDecoder(model, slots=2, length=16, use_graph=False, fused_kernels=False, stacked_qkv=True)
    assert stacked.qkv is not None and stacked.qkv.nbytes == decoder_bytes(model)
