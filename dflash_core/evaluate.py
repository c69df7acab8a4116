"""Acceptance length of a drafter against its target: greedy speculative decoding, block by block,
with the semantics of the reference loop.

  1. the target reads the prompt and yields the first token: the anchor;
  2. the drafter drafts a block from [anchor, MASK...] and the target features of every
     position before the anchor, in its layout: fill_in drafts B-1 tokens from slots 1..B-1,
     anchor_first B tokens from slots 0..B-1 (DeepSpec's `build_dspark_proposal`); the recipe
     drafts them (DSpark: left to right with the Markov bias);
  3. the target verifies the drafts; accepted = matching prefix + 1 (its own next token);
  4. the context grows by the accepted tokens' features; repeat.
tau = mean accepted length per block. Output is identical to target-only greedy decoding.
The target is re-run over the whole sequence each block (no KV cache): simple, and exact.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .devices import compute_dtype
from .drafter import DFlashDrafter, FrozenHead
from .step.micro_step import inference_block_forward
from .target import TargetModel


@dataclass
class SpeculativeOutput:
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance_lengths: list[int]
    # DSpark: per drafted position up to the first rejection, the confidence head's logit and
    # whether the target accepted it (what calibration fits)
    confidence: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class EvalResult:
    acceptance_lengths: list[int] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    lossless_mismatches: int = 0  # counted only when asked (check_lossless)
    confidence: list[tuple[float, float]] = field(default_factory=list)  # SpeculativeOutput.confidence

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
    """The argmax token of each row of logits [n, vocab]."""
    return logits.argmax(dim=-1).tolist()


def _argmax_one(logits: torch.Tensor) -> int:
    """The argmax token of one row of logits [vocab]."""
    return int(logits.argmax(dim=-1))


def target_pass(target: TargetModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (logits, features) over the token ids, on the target's device."""
    return target.forward_logits(torch.tensor(ids, device=target.device))


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DFlashDrafter,
    head: FrozenHead,
    prompt: list[int],
    *,
    max_new_tokens: int,
    stop_token_ids: set[int],
    autocast=contextlib.nullcontext,
) -> SpeculativeOutput:
    cfg = drafter.config
    ops, first, drafted = cfg.recipe_spec.hooks(), cfg.first_slot, cfg.draft_length
    logits, feats = target_pass(target, prompt)
    out = list(prompt) + [_argmax_one(logits[-1])]
    lengths: list[int] = []
    confidence: list[tuple[float, float]] = []
    while len(out) - len(prompt) < max_new_tokens and out[-1] not in stop_token_ids:
        anchor = len(out) - 1
        with autocast():
            hidden = block_hidden(drafter, head, feats, out)
            draft, conf_logits = ops.draft(drafter, head.lm_head_weight, hidden[first:], out[anchor])
        logits, full_feats = target_pass(target, out + draft)
        posterior = _argmax(logits[anchor:])  # the target's token after the anchor and each draft
        accepted = 0
        while accepted < drafted and draft[accepted] == posterior[accepted]:
            accepted += 1
        if conf_logits:
            confidence += [(conf_logits[k], float(k < accepted)) for k in range(min(accepted + 1, drafted))]
        new_tokens = draft[:accepted] + [posterior[accepted]]
        out += new_tokens
        feats = full_feats[: len(out) - 1]
        lengths.append(accepted + 1)
        if stop_token_ids.intersection(new_tokens):  # generation ended inside this block
            break
    return SpeculativeOutput(generated(out[len(prompt) :], max_new_tokens, stop_token_ids), lengths, confidence)


def block_hidden(drafter: DFlashDrafter, head: FrozenHead, feats: torch.Tensor, out: list[int]) -> torch.Tensor:
    """The drafter's final hidden states for the block anchored at the last token of `out`
    (the anchor, then mask tokens), from the target's features of the tokens before it."""
    cfg, anchor, device = drafter.config, len(out) - 1, head.embed_weight.device
    block = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=device)
    block[0] = out[anchor]
    return inference_block_forward(drafter, head, feats[:anchor].to(device), block, anchor)


def generated(tokens: list[int], max_new_tokens: int, stop_token_ids: set[int]) -> list[int]:
    """The new tokens, cut at max_new_tokens and after the first stop token."""
    gen = tokens[:max_new_tokens]
    for i, t in enumerate(gen):
        if t in stop_token_ids:
            return gen[: i + 1]
    return gen


@torch.no_grad()
def greedy_generate(
    target: TargetModel, prompt: list[int], *, max_new_tokens: int, stop_token_ids: set[int]
) -> list[int]:
    """Target-only greedy decoding (the lossless reference)."""
    out = list(prompt)
    while len(out) - len(prompt) < max_new_tokens:
        logits, _ = target.forward_logits(torch.tensor(out, device=target.device))
        out.append(_argmax_one(logits[-1]))
        if out[-1] in stop_token_ids:
            break
    return out[len(prompt) :]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt = the conversation up to its first assistant turn, with the generation prompt."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    text = tokenizer.apply_chat_template(messages[:first], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_ids(tokenizer) -> set[int]:
    return {i for i in (tokenizer.eos_token_id,) if i is not None}


def evaluate_acceptance(
    target: TargetModel,
    drafter: DFlashDrafter,
    tokenizer,
    conversations,
    *,
    max_new_tokens: int = 48,
    drafter_device=None,
    head: FrozenHead | None = None,
    check_lossless: bool = False,
    tokenizer_turn: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> EvalResult:
    """tau over held-out prompts (conversations or message lists). With check_lossless, each
    speculative output is also compared with target-only greedy decoding. tokenizer_turn: held
    around each use of the tokenizer, and only then (a thread sharing it takes its turns while
    the target and drafter decode)."""
    ddev = torch.device(drafter_device) if drafter_device is not None else next(drafter.parameters()).device
    if head is None:
        head = target.frozen_head().to(ddev, compute_dtype(ddev))
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if ddev.type == "cuda" else contextlib.nullcontext
    with tokenizer_turn():
        stops = stop_ids(tokenizer)
    was_training = drafter.training
    drafter.eval()
    result = EvalResult()
    try:
        for conv in conversations:
            messages = conv.messages if hasattr(conv, "messages") else conv
            with tokenizer_turn():
                prompt = prompt_ids(tokenizer, messages)
            spec = speculative_generate(
                target, drafter, head, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stops, autocast=autocast
            )
            result.acceptance_lengths += spec.acceptance_lengths
            result.confidence += spec.confidence
            with tokenizer_turn():
                texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in (prompt, spec.tokens)]
            result.samples.append(
                {
                    "prompt": texts[0],
                    "output": texts[1],
                    "acceptance_length": sum(spec.acceptance_lengths) / max(1, len(spec.acceptance_lengths)),
                }
            )
            if check_lossless:
                greedy = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stops)
                result.lossless_mismatches += spec.tokens != greedy
    finally:
        drafter.train(was_training)
    return result


def evaluate_checkpoint(
    checkpoint: str,
    prompts: str,
    *,
    target_path: str | None = None,
    device: str = "cpu",
    max_prompts: int = 32,
    max_new_tokens: int = 64,
    data_dir: str | None = None,
    check_lossless: bool = False,
) -> dict:
    """Load a drafter checkpoint and its target, measure tau on a JSONL of conversations.

    target_path: the target's directory (the caller's --target, or the daemon's configured one);
    None: the embedded default. Checkpoints record their target by identity, never by a path, so
    the summary says whether this target's config is the one the drafter was trained with
    (`target_matches`: None where the checkpoint records none).
    With check_lossless, every speculative output is compared with target-only greedy decoding.
    """
    from pathlib import Path

    from transformers import AutoTokenizer

    from .checkpoint import load_drafter, read_metadata
    from .data.conversations import read_conversations
    from .data_home import default_data_dir
    from .devices import usable_device
    from .target_identity import target_identity

    usable_device(device)
    for name, value in (("max_prompts", max_prompts), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if target_path is not None and not (Path(target_path) / "config.json").is_file():
        raise ValueError(f"target {target_path}: not a model directory (no config.json)")
    if target_path is None:
        from .defaults import ensure_default_assets

        target_path = str(ensure_default_assets(data_dir or default_data_dir()).target)
    convs = list(read_conversations(prompts))[:max_prompts]
    if not convs:
        raise ValueError(f"{prompts}: no conversations to evaluate on")
    drafter = load_drafter(checkpoint, device)
    target = TargetModel(target_path, drafter.config.target_layer_ids, device)
    cfg = drafter.config
    fits = (target.hidden_size, int(target.config.vocab_size), len(target.decoder_layers()))
    if fits != (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers):
        raise ValueError(
            f"target {target_path} does not fit the drafter: hidden_size, vocab_size, layers {fits}, "
            f"the drafter was trained for {(cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers)}"
        )
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    result = evaluate_acceptance(
        target, drafter, tokenizer, convs, max_new_tokens=max_new_tokens, check_lossless=check_lossless
    )
    summary = result.summary()
    summary["per_prompt"] = [
        {"prompt": s["prompt"][-60:], "acceptance_length": round(s["acceptance_length"], 2), "output": s["output"][:60]}
        for s in result.samples
    ]
    if check_lossless:
        summary["lossless_mismatches"] = result.lossless_mismatches
    summary["checkpoint"], summary["target"] = str(checkpoint), str(target_path)
    recorded = read_metadata(checkpoint).get("target")
    if isinstance(recorded, dict) and recorded.get("config_sha256"):
        summary["target_matches"] = recorded["config_sha256"] == target_identity(target_path)["config_sha256"]
    else:
        summary["target_matches"] = None
    return summary
