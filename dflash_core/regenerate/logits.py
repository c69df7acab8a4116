"""The logits a causal LM's own forward gives from its last hidden states, for the decoder's
sampling: the output head, then what some families do to its output in their forward (after the
head, so the decoder, which calls the head itself, must do it too). Greedy tokens do not change
with these (each is increasing), but a sampled token's distribution does."""

from __future__ import annotations

from typing import Any

import torch


class OutputLogits:
    """head(hidden), then as the family's forward: Granite divides by `logits_scaling`, Cohere
    multiplies by `logit_scale`, Gemma 2 and 3 soft-cap at `final_logit_softcapping` (each op in
    the forward's order, rounded where it rounds)."""

    def __init__(self, model: Any):
        self.head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.divide = float(getattr(config, "logits_scaling", None) or 1.0)
        scale = getattr(model, "logit_scale", None)  # Cohere keeps it on the model, from its config
        scale = scale if isinstance(scale, int | float) else getattr(config, "logit_scale", None)
        self.scale = float(scale) if isinstance(scale, int | float) else 1.0
        cap = getattr(config, "final_logit_softcapping", None)
        self.softcap = float(cap) if cap else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.divide != 1.0:
            logits = logits / self.divide
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
