"""Conversation -> token ids + loss mask (True on assistant tokens only), via the chat template."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .conversations import Conversation, DatasetError

_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclass
class Document:
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]
    source: str


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans produced by assistant turns.

    A turn's span runs from the end of the generation prompt to the end of the turn (its
    end-of-turn marker included: the drafter must learn to stop). Templates that render history
    differently from the last turn (e.g. Qwen3's empty think block) break prefix stability; then
    the span is found by searching the turn's content and the end marker in the full text.
    """
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full.startswith(through) and through.startswith(before) and len(before) >= cursor:
            spans.append((len(before), len(through)))
            cursor = len(through)
            continue
        # The turn starts after everything before it; history renders stably in such templates.
        cursor = max(cursor, len(_render(tokenizer, messages[:i], add_generation_prompt=False)) if i else 0)
        content = m["content"]
        start = full.find(content, cursor) if content else -1
        if start < 0 and "<think>" in content:  # templates that drop reasoning from earlier turns
            content = _THINK.sub("", content).strip()
            start = full.find(content, cursor) if content else -1
        if start < 0:
            raise ValueError(f"assistant turn {i} not found in the rendered chat template")
        end = start + len(content)
        eos = tokenizer.eos_token or ""
        if eos and full.startswith(eos, end):
            end += len(eos)
        spans.append((start, end))
        cursor = end
    return full, spans


def encode_conversation(tokenizer, conv: Conversation) -> Document:
    """Full conversation; packing truncates to the micro-batch budget (and counts what it cut)."""
    try:
        text, spans = assistant_char_spans(tokenizer, conv.messages)
    except Exception as e:  # noqa: BLE001 - template errors carry no location: add it
        path, _, line = conv.source.rpartition(":")
        raise DatasetError(path, int(line or 0), f"chat template failed: {e}") from None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offsets = enc["offset_mapping"]
    mask = np.zeros(len(ids), dtype=bool)
    if spans:
        starts = np.asarray([o[0] for o in offsets])
        ends = np.asarray([o[1] for o in offsets])
        for lo, hi in spans:
            mask |= (starts >= lo) & (ends <= hi) & (ends > starts)
    return Document(ids, mask, conv.source)
