"""Conversation -> token ids + loss mask (True on assistant tokens only), via the chat template."""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .conversations import Conversation

_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclass
class Document:
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]
    source: str
    cut: bool = False  # tokens past a max_tokens were left out


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

    def probe(self, tokenizer, messages, add_generation_prompt: bool, seconds: float | None = None) -> str:
        """render(), within `seconds` (default PROBE_SECONDS): the admission checks' render of a
        small conversation, which a template that loops for hours would otherwise hold (with the
        request waiting and a CPU core taken) past any client's patience; RenderTooSlow past it."""
        with time_bound(PROBE_SECONDS if seconds is None else seconds, "rendering the chat template"):
            text = self.render(tokenizer, messages, add_generation_prompt)
        text.encode("utf-8")  # a surrogate the template wrote would fail every tokenization later
        return text


DEFAULT_TEMPLATE = ChatTemplate()
# a template renders a short conversation in milliseconds; a probe that takes seconds is a loop
PROBE_SECONDS = 5.0


class RenderTooSlow(Exception):
    """Python work that went on past its time bound (time_bound)."""


@contextmanager
def time_bound(seconds: float, what: str) -> Iterator[None]:
    """Python code run inside, in this thread, raises RenderTooSlow once `seconds` have passed.
    A trace function of this thread alone looks at the clock every few hundred lines: Jinja
    compiles a template to Python, so its loops run such lines (a single long C call, a huge
    string's repetition, say, is not interrupted). The thread's earlier trace function (a
    coverage tool's) is put back after."""
    deadline = time.monotonic() + seconds
    events = 0

    def local(frame, event, arg):
        nonlocal events
        events += 1
        if events % 256 == 0 and time.monotonic() > deadline:
            raise RenderTooSlow(f"{what} took more than {seconds:g} s")
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local)
    try:
        yield
    finally:
        sys.settrace(previous)


def assistant_char_spans(
    tokenizer,
    messages: list[dict[str, str]],
    template: ChatTemplate = DEFAULT_TEMPLATE,
    full: str | None = None,
    until: int | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text (`full`, when the caller has rendered it) and the character spans produced
    by assistant turns, those that start before character `until` where given.

    A turn's span runs from the end of the generation prompt to the end of the turn (its
    end-of-turn marker included: the drafter must learn to stop). Templates that render history
    differently from the last turn (e.g. Qwen3's empty think block) break prefix stability; then
    the span is found by searching the turn's content and the end marker in the full text.
    Each turn renders the conversation up to it, so the work grows with the square of the turns:
    `until` (the end of the tokens kept) stops it where the tokens kept end.
    """

    def _render(tok, msgs, add_generation_prompt: bool) -> str:
        return template.render(tok, msgs, add_generation_prompt)

    if full is None:
        full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if until is not None and cursor >= until:
            break  # every later span starts at or after the cursor: past the tokens kept
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        # the last turn's render is the whole conversation's, which `full` already is
        through = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
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


# A text longer than twice this many characters per token kept is tokenized from prefixes, not
# whole (tokens average a few characters in every tokenizer the daemon serves, so a prefix this
# long almost always holds the tokens kept): a record of megabytes would otherwise cost gigabytes
# of token objects for the few thousand tokens a micro-batch takes of it.
PREFIX_CHARS_PER_TOKEN = 16


def encode_conversation(
    tokenizer, conv: Conversation, template: ChatTemplate = DEFAULT_TEMPLATE, max_tokens: int | None = None
) -> Document:
    """The conversation's tokens and loss mask: all of them, or at most max_tokens, the rest
    counted as cut (packing truncates each document to the micro-batch's length anyway). The
    assistant turns past the tokens kept are not looked for, so a template that fails only on
    such a turn's history does not fail the record."""
    try:
        text = template.render(tokenizer, conv.messages, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - template errors carry no location: add it
        raise conv.error(f"chat template failed: {e}") from None
    ids, offsets, cut = _encode(tokenizer, text, max_tokens)
    try:  # the turns past the tokens kept need no span
        _, spans = assistant_char_spans(tokenizer, conv.messages, template, text, int(offsets[-1, 1]) if cut else None)
    except Exception as e:  # noqa: BLE001 - as above
        raise conv.error(f"chat template failed: {e}") from None
    mask = np.zeros(len(ids), dtype=bool)
    if spans and len(ids):
        starts, ends = offsets[:, 0], offsets[:, 1]
        for lo, hi in spans:
            mask |= (starts >= lo) & (ends <= hi) & (ends > starts)
    return Document(ids, mask, conv.source, cut)


def _encode(tokenizer, text: str, max_tokens: int | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, [T, 2] character offsets, whether tokens were cut) of text's first max_tokens tokens.

    A long text is tokenized from prefixes that end before a space, of doubling length, until
    two of them agree on the tokens kept, where the tokenizer splits its text into words at spaces
    before its model sees it (a GPT-style regex, whitespace, a splitting metaspace): its model
    then tokenizes each word alone, so a prefix that ends with a whole word has the whole text's
    tokens (the second prefix guards pre-tokenizers that join a space to the word before it). A
    text with no space to cut at in the second half of a prefix's length is tokenized from a
    longer prefix, or whole; so is every text of a tokenizer that does not split at spaces (its
    model may choose a word's first pieces by where the word ends).
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    long = max_tokens is not None and len(text) > 2 * PREFIX_CHARS_PER_TOKEN * max_tokens
    if long and max_tokens is not None and splits_at_spaces(tokenizer):
        earlier: tuple[np.ndarray, np.ndarray] | None = None
        length = PREFIX_CHARS_PER_TOKEN * max_tokens
        while length < len(text):
            cut = _word_end(text, length)
            if cut:
                prefix = _tokens(tokenizer, text[:cut])
                if earlier is not None and len(earlier[0]) > max_tokens and _agree(*earlier, *prefix, max_tokens):
                    return earlier[0][:max_tokens], earlier[1][:max_tokens], True
                earlier = prefix
            length *= 2
    ids, offsets = _tokens(tokenizer, text)
    if max_tokens is not None and len(ids) > max_tokens:
        return ids[:max_tokens], offsets[:max_tokens], True
    return ids, offsets, False


# pre-tokenizers that end a word where a non-space character meets a space (U+0020), besides
# byte-level with its regex, a splitting metaspace and the regex splits of the GPT family (a
# space starts a word there, never ends one): whitespace splits and BERT's
_SPLITTING = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}


def splits_at_spaces(tokenizer) -> bool:
    """Whether the tokenizer's words end where a non-space character meets a space: a fast
    tokenizer whose pre-tokenizer (or one in its sequence) is such a split, and whose normalizer
    leaves it spaces to split at (Gemma's replaces them with its metaspace character before a
    split on spaces, which then splits nothing)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None or not _splits_json(pre.__getstate__()):
        return False
    normalizer = getattr(backend, "normalizer", None)
    probe = normalizer.normalize_str("ab cd") if normalizer is not None else "ab cd"
    return len(pre.pre_tokenize_str(probe)) > 1


@functools.lru_cache(maxsize=64)
def _splits_json(spec: bytes) -> bool:
    return _splits(json.loads(spec))


def _splits(spec: object) -> bool:
    if not isinstance(spec, dict):
        return False
    kind = spec.get("type")
    if kind == "Sequence":
        return any(_splits(member) for member in spec.get("pretokenizers") or [])
    if kind == "ByteLevel":
        return bool(spec.get("use_regex", True))
    if kind == "Metaspace":
        return bool(spec.get("split", True))
    if kind == "Split":  # a regex split of the GPT family matches whitespace; a split on digits alone does not
        pattern = spec.get("pattern") or {}
        return pattern.get("String") == " " or "\\s" in (pattern.get("Regex") or "")
    return kind in _SPLITTING


_WORD_END = re.compile(r"\S(?= )")


def _word_end(text: str, length: int) -> int:
    """The end of the last word that a space follows at most `length` characters in and in the
    second half of them (the space not included), or 0 where none does."""
    for lo in (max(length // 2, length - 4096), length // 2):  # near the end first
        ends = [m.end() for m in _WORD_END.finditer(text, lo, length + 1)]
        if ends:
            return ends[-1]
    return 0


def _tokens(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    backend = _plain_backend(tokenizer)
    if backend is not None:
        # what the call below runs, without the Python around it: half of a short record's
        # tokenizing. encode_batch, as the call uses it, lets the GIL go while it tokenizes
        # (`encode` would hold it: a long text would stall a training thread beside this one)
        enc = backend.encode_batch([text], add_special_tokens=False)[0]
        ids, offsets = enc.ids, enc.offsets
    else:
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = out["input_ids"], out["offset_mapping"]
    return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


def _plain_backend(tokenizer):
    """The fast tokenizer's backend where calling the tokenizer (no special tokens added, no
    truncation, no padding) is one `encode_batch` of it: transformers' own encode path, not a
    class's override of it, and a backend with no truncation or padding set (the call would
    switch them off first) and the tokenizer's own choice of splitting special tokens; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _plain_call(type(tokenizer)):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


@functools.lru_cache(maxsize=64)
def _plain_call(cls: type) -> bool:
    """Whether the class runs transformers' fast `__call__` and `_encode_plus` unchanged."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the call itself
        return False
    if not issubclass(cls, TokenizersBackend):
        return False
    same = cls.__call__ is PreTrainedTokenizerBase.__call__ and cls._encode_plus is TokenizersBackend._encode_plus
    # a class with an input mode (source-language tokens and the like) sets it at each call
    return same and not hasattr(cls, "_switch_to_input_mode")


def _agree(ids: np.ndarray, offsets: np.ndarray, ids2: np.ndarray, offsets2: np.ndarray, n: int) -> bool:
    return len(ids2) >= n and np.array_equal(ids[:n], ids2[:n]) and np.array_equal(offsets[:n], offsets2[:n])
