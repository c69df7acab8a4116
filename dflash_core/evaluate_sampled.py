"""Acceptance length at a sampling temperature (the DSpark paper's setting is temperature 1):
speculative sampling with the standard rejection rule (Leviathan et al. 2023; what SGLang and
vLLM verify with), so the output is distributed as the target's own sampling at that temperature.

Per block: the drafter samples the block's D tokens (D = B-1 fill-in, B anchor-first) from its
distributions q_k (DFlash: each slot on its own; DSpark: left to right with the Markov bias,
`recipes.dspark.markov_sample`); the target gives
p_k for each; draft token x_k is accepted with probability min(1, p_k(x_k) / q_k(x_k)); at the
first rejection a token is drawn from max(0, p_k - q_k) renormalised and the block ends; when all
are accepted a bonus token is drawn from the target's next distribution. tau = tokens per block.
"""

from __future__ import annotations

import contextlib

import torch

from .drafter import DFlashDrafter, FrozenHead
from .evaluate import SpeculativeOutput, block_hidden, generated, target_pass
from .target import TargetModel


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def verify_token(p: torch.Tensor, q: torch.Tensor, x: int, generator: torch.Generator) -> tuple[bool, int]:
    """One position: (accepted, the token kept: x, or a draw from the residual max(0, p - q))."""
    ratio = float(p[x]) / max(float(q[x]), 1e-30)
    if float(torch.rand((), generator=generator)) < min(1.0, ratio):
        return True, x
    residual = (p - q).clamp_min(0)
    total = float(residual.sum())
    return False, _sample(residual / total if total > 0 else p, generator)


@torch.no_grad()
def draft_sampled(
    drafter: DFlashDrafter, head: FrozenHead, hidden: torch.Tensor, anchor: int, temperature: float, generator
) -> tuple[list[int], torch.Tensor]:
    """(the block's D drafted tokens, their distributions q [D, V]) at `temperature`, from the
    block's hidden states [B, H] (its layout's predicting slots)."""
    cfg = drafter.config
    slots = hidden[cfg.first_slot :]
    return cfg.recipe_spec.hooks().sample(drafter, head.lm_head_weight, slots, anchor, temperature, generator)


@torch.no_grad()
def speculative_sample(
    target: TargetModel,
    drafter: DFlashDrafter,
    head: FrozenHead,
    prompt: list[int],
    *,
    temperature: float,
    max_new_tokens: int,
    stop_token_ids: set[int],
    generator: torch.Generator,
    autocast=contextlib.nullcontext,
) -> SpeculativeOutput:
    drafted = drafter.config.draft_length
    logits, feats = target_pass(target, prompt)
    out = list(prompt) + [_sample(torch.softmax(logits[-1].float() / temperature, -1), generator)]
    lengths: list[int] = []
    while len(out) - len(prompt) < max_new_tokens and out[-1] not in stop_token_ids:
        anchor = len(out) - 1
        with autocast():
            hidden = block_hidden(drafter, head, feats, out)
            draft, q = draft_sampled(drafter, head, hidden, out[anchor], temperature, generator)
        logits, full_feats = target_pass(target, out + draft)
        p = torch.softmax(logits[anchor:].float() / temperature, dim=-1)  # p[k]: the token after block position k
        new_tokens: list[int] = []
        for k in range(drafted):
            accepted, token = verify_token(p[k], q[k].to(p.device), draft[k], generator)
            new_tokens.append(token)
            if not accepted:
                break
        else:
            new_tokens.append(_sample(p[drafted], generator))
        out += new_tokens
        feats = full_feats[: len(out) - 1]
        lengths.append(len(new_tokens))
        if stop_token_ids.intersection(new_tokens):
            break
    return SpeculativeOutput(generated(out[len(prompt) :], max_new_tokens, stop_token_ids), lengths)


def sampled_acceptance_length(
    target: TargetModel,
    drafter: DFlashDrafter,
    head: FrozenHead,
    tokenizer,
    conversations,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 48,
    seed: int = 0,
) -> float:
    """tau at `temperature` over held-out prompts (conversations or message lists)."""
    from .evaluate import prompt_ids, stop_ids

    generator = torch.Generator().manual_seed(seed)
    stops = stop_ids(tokenizer)
    was_training = drafter.training
    drafter.eval()
    lengths: list[int] = []
    try:
        for conv in conversations:
            messages = conv.messages if hasattr(conv, "messages") else conv
            spec = speculative_sample(
                target,
                drafter,
                head,
                prompt_ids(tokenizer, messages),
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stops,
                generator=generator,
            )
            lengths += spec.acceptance_lengths
    finally:
        drafter.train(was_training)
    return sum(lengths) / len(lengths) if lengths else 0.0
