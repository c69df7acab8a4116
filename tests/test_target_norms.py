"""Which modules the norm dispatchers take (target_norms.py), and that a target with them is
still what the compiler traces and the eager forward computes when they are off."""

from __future__ import annotations

import torch
from torch import nn

from dflash_core.target_norms import NormKernels, base_class, norm_epsilon
from tests.tiny_decoders import tiny_sliding_qwen3


def test_norms_are_found_by_their_shape_not_their_name():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert norm_epsilon(LlamaRMSNorm(8, eps=1e-5)) == 1e-5
    assert norm_epsilon(Gemma3RMSNorm(8, eps=1e-6)) == 1e-6
    assert norm_epsilon(nn.LayerNorm(8)) is None  # a bias beside the weight
    assert norm_epsilon(nn.Linear(8, 8, bias=False)) is None  # a 2-D weight
    assert norm_epsilon(nn.Sequential(LlamaRMSNorm(8))) is None  # children


def test_dispatchers_are_installed_once_and_off_by_default():
    model = tiny_sliding_qwen3()
    x = torch.randint(2, 128, (2, 9))
    with torch.no_grad():
        before = model(x).logits
    kernels = NormKernels.of(model)
    # per layer: input, post-attention, query and key norms; and the final norm
    assert kernels.count == 3 * 4 + 1
    assert NormKernels.of(model) is kernels and NormKernels(model).count == 0  # taken norms stay
    norm = model.model.layers[0].input_layernorm
    assert isinstance(norm, base_class(norm)) and type(norm).__name__ == "Qwen3RMSNorm"
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)  # off: each norm's own forward
        # the compiler sees the norm's own forward even inside active(): what a compiled capture traces
        layer = model.model.layers[0]
        norm = layer.input_layernorm
        h = torch.randn(2, 5, 64)
        compiled = torch.compile(lambda t: norm(t), fullgraph=True, backend="eager")
        with kernels.active():
            assert kernels.match() == {"Qwen3RMSNorm": None}  # on the CPU, unprobed classes stay eager
            assert torch.equal(compiled(h), base_class(norm).forward(norm, h))


def test_a_copied_target_carries_dispatchers_of_its_own():
    import copy

    model = tiny_sliding_qwen3()
    kernels = NormKernels.of(model)
    kernels.match()
    twin = copy.deepcopy(model)
    twin_kernels = NormKernels.of(twin)
    assert twin_kernels is not kernels and twin_kernels.count == kernels.count
    norm = twin.model.layers[0].input_layernorm
    assert norm.__dict__["_dflash_norms"] is twin_kernels
    with torch.no_grad():
        norm.weight.mul_(2)  # the copy's weights are its own: the original's output stays
        x = torch.randint(2, 128, (1, 7))
        assert not torch.equal(twin(x).logits, model(x).logits)
        with twin_kernels.active():  # a fresh thread state and lock: usable at once
            assert twin_kernels.match() == kernels.match()


def test_a_pickled_target_loads_with_its_own_norm_classes():
    import pickle

    model = tiny_sliding_qwen3()
    NormKernels.of(model).match()
    loaded = pickle.loads(pickle.dumps(model))
    norm = loaded.model.layers[0].input_layernorm
    # the dispatching class stays in the process that made it; what loads is transformers' class
    assert type(norm) is base_class(model.model.layers[0].input_layernorm)
    assert not any(k.startswith("_dflash_") for k in norm.__dict__)
    x = torch.randint(2, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    assert NormKernels.of(loaded).count == NormKernels.of(model).count  # installed anew on the loaded model
