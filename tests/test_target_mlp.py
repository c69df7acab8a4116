"""Which modules the gated-MLP dispatchers take (target_mlp.py), and that a target with them is
still what the compiler traces and the eager forward computes when they are off. The kernel's
path itself runs through Triton's interpreter in tests/decode_attention_check.py."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from dflash_core.target_mlp import MlpKernels, gated_mlp
from dflash_core.target_norms import base_class
from tests.tiny_decoders import tiny_llama, tiny_sliding_qwen3


def test_gated_mlps_are_found_by_their_parts_not_their_name():
    from transformers import Gemma3TextConfig, LlamaConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    llama = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
    gemma = Gemma3TextConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
    assert gated_mlp(LlamaMLP(llama))
    assert gated_mlp(Gemma3MLP(gemma))  # a candidate; its GELU is refused by the probe, not by name

    class NoGate(nn.Module):  # two projections only: not gated
        def __init__(self):
            super().__init__()
            self.up_proj, self.down_proj, self.act_fn = nn.Linear(4, 8), nn.Linear(8, 4), nn.SiLU()

    class OwnScale(LlamaMLP):  # a parameter of its own beside the projections: its forward is its own
        def __init__(self, config):
            super().__init__(config)
            self.scale = nn.Parameter(torch.ones(1))

    assert not gated_mlp(NoGate())
    assert not gated_mlp(OwnScale(llama))
    assert not gated_mlp(nn.Linear(4, 4))


def test_dispatchers_are_installed_once_and_off_by_default():
    model = tiny_sliding_qwen3()
    x = torch.randint(2, 128, (2, 9))
    with torch.no_grad():
        before = model(x).logits
    kernels = MlpKernels.of(model)
    assert kernels.count == len(model.model.layers)
    assert MlpKernels.of(model) is kernels and MlpKernels(model).count == 0  # taken MLPs stay
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, base_class(mlp)) and type(mlp).__name__ == "Qwen3MLP"
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)  # off: each MLP's own forward
        h = torch.randn(2, 5, model.config.hidden_size)
        compiled = torch.compile(lambda t: mlp(t), fullgraph=True, backend="eager")
        with kernels.active():
            # fp32 on the CPU without the interpreter: the class is probed and stays eager
            assert kernels.match() == {"Qwen3MLP": False} and not kernels.usable()
            # the compiler sees the MLP's own forward even inside active(): what a compiled capture traces
            assert torch.equal(compiled(h), base_class(mlp).forward(mlp, h))
            assert torch.equal(mlp(h), base_class(mlp).forward(mlp, h))


def test_a_copied_target_carries_dispatchers_of_its_own():
    model = tiny_llama()
    kernels = MlpKernels.of(model)
    kernels.match()
    twin = copy.deepcopy(model)
    twin_kernels = MlpKernels.of(twin)
    assert twin_kernels is not kernels and twin_kernels.count == kernels.count
    mlp = twin.model.layers[0].mlp
    assert mlp.__dict__["_dflash_mlp"] is twin_kernels
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)  # the copy's weights are its own: the original's output stays
        x = torch.randint(2, 128, (1, 7))
        assert not torch.equal(twin(x).logits, model(x).logits)
        with twin_kernels.active():  # a fresh thread state and lock: usable at once
            assert twin_kernels.match() == kernels.match()


def test_a_pickled_target_loads_with_its_own_mlp_classes():
    model = tiny_sliding_qwen3()
    MlpKernels.of(model).match()
    loaded = pickle.loads(pickle.dumps(model))
    mlp = loaded.model.layers[0].mlp
    # the dispatching class stays in the process that made it; what loads is transformers' class
    assert type(mlp) is base_class(model.model.layers[0].mlp)
    assert not any(k.startswith("_dflash_") for k in mlp.__dict__)
    x = torch.randint(2, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    assert MlpKernels.of(loaded).count == MlpKernels.of(model).count  # installed anew on the loaded model
