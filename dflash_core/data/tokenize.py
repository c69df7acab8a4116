"""Conversation -> token ids + loss mask (True on assistant tokens only), via the chat template."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .conversations import Conversation

_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclass
class Document:
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]
    source: str


@dataclass(frozen=True)
class ChatTemplate:
    """How conversations are rendered: the tokenizer's own template or a given one, and the
    options the template reads (e.g. Qwen3's `enable_thinking`)."""

    template: str | None = None  # None: the tokenizer's chat template
    kwargs: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, template: str | None = None, kwargs: dict[str, object] | None = None) -> ChatTemplate:
        return cls(template, tuple(sorted((kwargs or {}).items())))

    def render(self, tokenizer, messages, add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.template,
            **dict(self.kwargs),
        )


DEFAULT_TEMPLATE = ChatTemplate()


def assistant_char_spans(
    tokenizer, messages: list[dict[str, str]], template: ChatTemplate = DEFAULT_TEMPLATE
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans produced by assistant turns.

    A turn's span runs from the end of the generation prompt to the end of the turn (its
    end-of-turn marker included: the drafter must learn to stop). Templates that render history
    differently from the last turn (e.g. Qwen3's empty think block) break prefix stability; then
    the span is found by searching the turn's content and the end marker in the full text.
    """

    def _render(tok, msgs, add_generation_prompt: bool) -> str:
        return template.render(tok, msgs, add_generation_prompt)

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


def encode_conversation(tokenizer, conv: Conversation, template: ChatTemplate = DEFAULT_TEMPLATE) -> Document:
    """Full conversation; packing truncates to the micro-batch budget (and counts what it cut)."""
    try:
        text, spans = assistant_char_spans(tokenizer, conv.messages, template)
    except Exception as e:  # noqa: BLE001 - template errors carry no location: add it
        raise conv.error(f"chat template failed: {e}") from None
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
