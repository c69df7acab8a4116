"""The slot decoder runs a family's model as its own forward does, where the family differs from
a plain decoder: LongRoPE picks its factors from the forward's largest position (an idle slot's
parked position must not decide it), Granite divides its logits after the head (a sampled token
follows the model's own distribution), and attention with soft-capped scores, which no attention
path of the decoder computes, is refused rather than decoded uncapped."""

from __future__ import annotations

import pytest
import torch

from dflash_core.regenerate.decode import Request, SlotDecoder
from dflash_core.regenerate.sampling import Sampling, choose_tokens


def _longrope_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    rope = {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [8.0] * 8,
        "original_max_position_embeddings": 16,
    }  # fmt: skip
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, rope_parameters=rope,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("slots", [1, 4, 6])
def test_longrope_with_idle_slots_equals_generate(slots):
    """Sequences within the short factors' range (16 positions) in a cache of 40: with idle
    slots parked at position 39, the long factors were taken for every sequence."""
    model = _longrope_llama()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (5, 3, 7)]
    with torch.no_grad():
        want = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, pad_token_id=0)[0, len(p) :].tolist()
            for p in prompts
        ]
    decoder = SlotDecoder(model, slots=slots, length=40)
    got = {c.key: c.tokens for c in decoder.generate([Request(k, p, 8) for k, p in enumerate(prompts)], Sampling())}
    assert [got[k] for k in range(len(prompts))] == want


def _granite(scaling: float = 16.0):
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    cfg = GraniteConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, logits_scaling=scaling,
    )  # fmt: skip
    model = GraniteForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():  # a head whose scaled logits spread about one unit: a broad distribution
        h = model.model(torch.tensor([[5, 17, 33, 2, 90]])).last_hidden_state[:, -1]
        model.lm_head.weight = torch.nn.Parameter(torch.randn(128, 64) * scaling / (h.norm() + 1e-6))
    return model


@pytest.mark.parametrize("ride_rows", [0, 8])  # the first token from a prefill, or from a decode step
def test_sampled_tokens_follow_the_models_own_logits(ride_rows):
    model = _granite()
    prompt, seeds = [5, 17, 33, 2, 90], list(range(48))
    decoder = SlotDecoder(model, slots=4, length=40, ride_rows=ride_rows)
    sampling = Sampling(temperature=1.0)
    # two long sequences keep decoding, so that with riding rows the others ride in their steps
    requests = [Request(f"long{i}", prompt, 24, seed=1000 + i) for i in range(2)]
    requests += [Request(s, prompt, 2, seed=s) for s in seeds]
    got = {c.key: c.tokens for c in decoder.generate(requests, sampling)}
    if ride_rows:
        assert decoder.riding_steps > 0
    one, k0, n = torch.ones(1), torch.zeros(1, dtype=torch.long), len(seeds)
    with torch.no_grad():  # each step's token as the model's forward gives its logits, same seed and step
        for step in range(2):
            ids = torch.tensor([prompt + got[s][:step] for s in seeds])
            logits = model(ids).logits[:, -1]
            steps = torch.full((n,), step, dtype=torch.long)
            want = choose_tokens(logits, torch.tensor(seeds), steps, "sample", one, k0, one).tolist()
            assert [got[s][step] for s in seeds] == want, step
            unscaled = choose_tokens(logits * 16, torch.tensor(seeds), steps, "sample", one, k0, one).tolist()
            assert unscaled != want  # the scaling matters to these draws


def test_attention_with_soft_capped_scores_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, attn_logit_softcapping=50.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="soft-capped scores"):
        SlotDecoder(Gemma2ForCausalLM(cfg).eval(), slots=2, length=16)


def test_scaled_logits_are_refused_for_training():
    """The drafter's loss is a plain softmax over the head, as for Cohere's logit_scale."""
    from transformers import CohereConfig, GraniteConfig

    from dflash_core.parity import TargetRefused, check_serving_parity

    with pytest.raises(TargetRefused, match=r"scales its logits \(logits_scaling=16.0\)"):
        check_serving_parity(GraniteConfig(num_hidden_layers=4, logits_scaling=16.0), 4, [1, 2])
    with pytest.raises(TargetRefused, match=r"scales its logits \(logit_scale=0.0625\)"):
        check_serving_parity(CohereConfig(num_hidden_layers=4, logit_scale=0.0625), 4, [1, 2])
    check_serving_parity(GraniteConfig(num_hidden_layers=4, logits_scaling=1.0), 4, [1, 2])
