"""Acceptance length of a drafter against its target: greedy speculative decoding, block by block,
with the semantics of the reference loop.

  1. the target reads the prompt and yields the first token: the anchor;
  2. the drafter drafts B-1 tokens from [anchor, MASK...] and the target features of every
     position before the anchor;
  3. the target verifies the block; accepted = matching prefix + 1 (its own next token);
  4. the context grows by the accepted tokens' features; repeat.
tau = mean accepted length per block. Output is identical to target-only greedy decoding.
The target is re-run over the whole sequence each block (no KV cache): simple, and exact.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from .drafter import DFlashDrafter
from .target import TargetModel
from .train_step import FrozenHead, inference_block_forward


@dataclass
class SpeculativeOutput:
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance_lengths: list[int]


@dataclass
class EvalResult:
    acceptance_lengths: list[int] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    def summary(self) -> dict:
        hist = Counter(self.acceptance_lengths)
        return {
            "acceptance_length": self.acceptance_length,
            "blocks": len(self.acceptance_lengths),
            "histogram": {str(k): hist[k] for k in sorted(hist)},
            "prompts": len(self.samples),
            "samples": self.samples[:4],
        }


def _argmax(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


@torch.no_grad()
def speculative_generate(
    target: TargetModel, drafter: DFlashDrafter, head: FrozenHead, prompt: list[int], *,
    max_new_tokens: int, stop_token_ids: set[int], autocast=contextlib.nullcontext,
) -> SpeculativeOutput:
    cfg = drafter.config
    b = cfg.block_size
    tdev, ddev = target.device, head.embed_weight.device
    logits, feats = target.forward_logits(torch.tensor(prompt, device=tdev))
    out = list(prompt) + [_argmax(logits[-1])]
    lengths: list[int] = []
    while len(out) - len(prompt) < max_new_tokens and out[-1] not in stop_token_ids:
        anchor = len(out) - 1
        block = torch.full((b,), cfg.mask_token_id, dtype=torch.long, device=ddev)
        block[0] = out[anchor]
        with autocast():
            hidden = inference_block_forward(drafter, head, feats[:anchor].to(ddev), block, anchor)
            draft = _argmax(hidden[1:].to(head.lm_head_weight.dtype) @ head.lm_head_weight.t())
        logits, full_feats = target.forward_logits(torch.tensor(out + draft, device=tdev))
        posterior = _argmax(logits[anchor:])  # target's token after each block position
        accepted = 0
        while accepted < b - 1 and draft[accepted] == posterior[accepted]:
            accepted += 1
        out += draft[:accepted] + [posterior[accepted]]
        feats = full_feats[: len(out) - 1]
        lengths.append(accepted + 1)
    gen = out[len(prompt):][:max_new_tokens]
    for i, t in enumerate(gen):
        if t in stop_token_ids:
            gen = gen[: i + 1]
            break
    return SpeculativeOutput(gen, lengths)


@torch.no_grad()
def greedy_generate(target: TargetModel, prompt: list[int], *, max_new_tokens: int, stop_token_ids: set[int]) -> list[int]:
    """Target-only greedy decoding (the lossless reference)."""
    out = list(prompt)
    while len(out) - len(prompt) < max_new_tokens:
        logits, _ = target.forward_logits(torch.tensor(out, device=target.device))
        out.append(_argmax(logits[-1]))
        if out[-1] in stop_token_ids:
            break
    return out[len(prompt):]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt = the conversation up to its first assistant turn, with the generation prompt."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    text = tokenizer.apply_chat_template(messages[:first], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_ids(tokenizer) -> set[int]:
    return {i for i in (tokenizer.eos_token_id,) if i is not None}


def evaluate_acceptance(
    target: TargetModel, drafter: DFlashDrafter, tokenizer, conversations, *, max_new_tokens: int = 48,
    drafter_device=None, head: FrozenHead | None = None,
) -> EvalResult:
    """tau over held-out prompts (conversations or message lists)."""
    ddev = torch.device(drafter_device) if drafter_device is not None else next(drafter.parameters()).device
    if head is None:
        dtype = torch.bfloat16 if ddev.type == "cuda" else torch.float32
        head = target.frozen_head().to(ddev, dtype)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if ddev.type == "cuda" else contextlib.nullcontext
    was_training = drafter.training
    drafter.eval()
    result = EvalResult()
    try:
        for conv in conversations:
            messages = conv.messages if hasattr(conv, "messages") else conv
            prompt = prompt_ids(tokenizer, messages)
            spec = speculative_generate(target, drafter, head, prompt, max_new_tokens=max_new_tokens,
                                        stop_token_ids=stop_ids(tokenizer), autocast=autocast)
            result.acceptance_lengths += spec.acceptance_lengths
            result.samples.append({
                "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                "output": tokenizer.decode(spec.tokens, skip_special_tokens=True),
                "acceptance_length": sum(spec.acceptance_lengths) / max(1, len(spec.acceptance_lengths)),
            })
    finally:
        drafter.train(was_training)
    return result
