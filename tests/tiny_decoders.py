"""Tiny fp32 decoders with random weights for the slot decoder's tests: one with full and sliding
layers, one with one layer kind, one with biases on its query, key and value projections."""

from __future__ import annotations

import torch


def tiny_sliding_qwen3(layers: int = 3):
    """A 3-layer fp32 Qwen3 with random weights: full, sliding (window 6) and full layers, GQA 2
    (layers=2: the first two, one of each kind)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    layer_types = ["full_attention", "sliding_attention", "full_attention"][:layers]
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        use_sliding_window=True, sliding_window=6, layer_types=layer_types,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def tiny_llama():
    """A 2-layer fp32 Llama with random weights, GQA 4: one layer kind, so its decoder takes one
    mask tensor (or what stands for it) through transformers' mask builder, not a dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2():
    """A 2-layer fp32 Qwen2 with random weights, GQA 2: biases on its q/k/v projections (random,
    so a dropped or misplaced bias shows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model
