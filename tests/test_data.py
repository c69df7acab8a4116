"""Conversation parsing, loss masks, fixed-shape packing and anchor coverage."""

import copy
import dataclasses
import itertools
import json

import numpy as np
import pytest

from dflash_core.config import ShapeConfig
from dflash_core.data.anchors import valid_anchor_positions
from dflash_core.data.batches import MicroBatchStream
from dflash_core.data.conversations import Conversation, DatasetError, ReadReport, read_conversations
from dflash_core.data.tokenize import encode_conversation


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_openai_and_sharegpt_formats(tmp_path, tokenizer):
    p = write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "spell sun"},
                        {"role": "assistant", "content": "s - u - n ."},
                    ]
                }
            ),
            json.dumps(
                {"conversations": [{"from": "human", "value": "spell sun"}, {"from": "gpt", "value": "s - u - n ."}]}
            ),
        ],
    )
    convs = list(read_conversations(p))
    docs = [encode_conversation(tokenizer, c) for c in convs]
    assert docs[0].input_ids.tolist() == docs[1].input_ids.tolist()
    toks = tokenizer.convert_ids_to_tokens(docs[0].input_ids[docs[0].loss_mask].tolist())
    assert toks == ["s", "-", "u", "-", "n", ".", "<|im_end|>"]  # assistant tokens only, end marker included


def test_malformed_lines_name_file_and_line(tmp_path):
    p = write_lines(
        tmp_path / "bad.jsonl",
        [
            json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
            "{not json",
            json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
            json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        ],
    )
    with pytest.raises(DatasetError) as e:
        list(read_conversations(p))
    assert str(e.value).startswith(f"{p}:2: invalid JSON")
    report = ReadReport()
    ok = list(read_conversations(p, skip_bad_lines=True, report=report))
    assert len(ok) == 1 and report.skipped == 3
    # the role is named as unknown, its value not echoed (errors are shown to whoever may list the jobs)
    assert any(":3:" in m and "unknown 'role'" in m and "wizard" not in m for m in report.first_errors)
    assert any(":4:" in m and "no assistant" in m for m in report.first_errors)


def test_no_trainable_document_after_packing_says_why(tmp_path, tokenizer):
    """A conversation whose assistant turn lies past seq_len is cut to a document with nothing to
    train on: the error says so, with the seq_len that cut it."""
    long_question = {"messages": [{"role": "user", "content": "hi " * 400}, {"role": "assistant", "content": "ok"}]}
    p = write_lines(tmp_path / "long.jsonl", [json.dumps(long_question)])
    docs = [encode_conversation(tokenizer, c) for c in read_conversations(p)]
    assert len(docs[0].input_ids) > 64 and docs[0].loss_mask.any()
    cut = [dataclasses.replace(d, input_ids=d.input_ids[:64], loss_mask=d.loss_mask[:64]) for d in docs]  # as prepared
    shape = ShapeConfig(seq_len=64, num_anchors=4, block_size=4)
    with pytest.raises(ValueError, match=r"none of the 1 documents has an assistant token within its first 64 tokens"):
        MicroBatchStream(cut, shape, tokenizer.pad_token_id, seed=0)


def load_default_docs(default_assets, tokenizer, limit=None):
    convs = list(read_conversations(default_assets.train))[:limit]
    return [encode_conversation(tokenizer, c) for c in convs]


def test_packing_shapes_are_identical(default_assets, tokenizer):
    docs = load_default_docs(default_assets, tokenizer, limit=300)
    shape = ShapeConfig(seq_len=256, num_anchors=32, block_size=8)
    stream = MicroBatchStream(docs, shape, tokenizer.pad_token_id, seed=0)
    shapes = {
        tuple(
            (k, tuple(getattr(mb, k).shape), getattr(mb, k).dtype)
            for k in ("input_ids", "position_ids", "doc_ids", "loss_mask", "anchors", "anchor_valid")
        )
        for mb in (stream.get(i) for i in range(stream.per_epoch * 2))
    }
    assert len(shapes) == 1
    assert stream.report.truncated_documents == 0


def test_every_trainable_token_is_covered_over_an_epoch(default_assets, tokenizer):
    """With the default shapes, every loss-masked token that can be a label is a label of some block."""
    from dflash_core.defaults import DEFAULT_SHAPE_CPU

    docs = load_default_docs(default_assets, tokenizer)
    shape = DEFAULT_SHAPE_CPU
    stream = MicroBatchStream(docs, shape, tokenizer.pad_token_id, seed=0)
    uncovered = total = 0
    for i in range(stream.per_epoch):
        mb = stream.get(i)
        doc, mask = mb.doc_ids.numpy(), mb.loss_mask.numpy()
        covered = np.zeros(len(doc), dtype=bool)
        for a, ok in zip(mb.anchors.numpy(), mb.anchor_valid.numpy()):
            if ok:
                end = min(a + shape.block_size, len(doc))
                covered[a + 1 : end] |= doc[a + 1 : end] == doc[a]
        # Labels are tokens t with a valid anchor t-1... i.e. loss-masked with a loss-masked predecessor.
        labelable = np.zeros(len(doc), dtype=bool)
        labelable[valid_anchor_positions(doc, mask) + 1] = True
        total += labelable.sum()
        uncovered += (labelable & ~covered).sum()
    assert total > 1000
    assert uncovered == 0, f"{uncovered} of {total} trainable tokens never a label"


# A template that renders the last assistant turn differently from history (as Qwen3's does with
# its empty think block), so the prefix-diff path fails and the content search must be used.
UNSTABLE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n<think> </think> ' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_loss_mask_with_a_template_whose_history_is_not_prefix_stable(tokenizer):
    from dflash_core.data.conversations import Conversation

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = UNSTABLE_TEMPLATE
    messages = [
        {"role": "user", "content": "red dog"},
        {"role": "assistant", "content": "dog"},
        {"role": "user", "content": "blue cat"},
        {"role": "assistant", "content": "cat"},
    ]
    doc = encode_conversation(tok, Conversation(messages, "mem:1"))
    toks = tok.convert_ids_to_tokens(doc.input_ids.tolist())
    masked = [i for i, m in enumerate(doc.loss_mask) if m]
    first_dog = toks.index("dog")  # the user's "dog" comes first and must stay unmasked
    assert first_dog not in masked
    reply = toks.index("dog", first_dog + 1)
    assert reply in masked and toks[reply + 1] == "<|im_end|>" and reply + 1 in masked
    assert len(toks) - 1 - toks[::-1].index("cat") in masked and toks.index("cat") not in masked
    assert not any(toks[i] in ("red", "blue", "user") for i in masked)


class _RecordingTokenizer:
    """A fast tokenizer of transformers over a `tokenizers` model built here, that keeps the
    length of every text it is asked to tokenize: byte-level BPE trained on a few sentences, or a
    unigram model over runs of "a", whose first pieces of a run depend on the run's whole length
    (the Viterbi segmentation), so a prefix cut inside a run changes tokens far before the cut."""

    def __init__(self, kind: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        if kind == "bpe":
            backend = Tokenizer(models.BPE())
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            backend.decoder = decoders.ByteLevel()
            words = "the red dog ran far 12345 over blue cats; naïve café ünïcode".split()
            corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
            trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"], show_progress=False)
            backend.train_from_iterator(corpus, trainer)
        else:
            pieces = [("<unk>", 0.0), ("a", -1.0), ("aa", -1.5), ("aaa", -2.2), ("b", -1.0), ("<|im_end|>", 0.0)]
            backend = Tokenizer(models.Unigram(pieces, unk_id=0))
            backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        self.inner = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
        self.inner.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        )
        self.lengths: list[int] = []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.inner(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _wrapped(backend) -> _RecordingTokenizer:
    """A _RecordingTokenizer over a `tokenizers` backend built by the caller."""
    from transformers import PreTrainedTokenizerFast

    tok = _RecordingTokenizer.__new__(_RecordingTokenizer)
    tok.inner = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tok.inner.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
    tok.lengths = []
    return tok


def test_prefixes_end_only_where_the_tokenizer_ends_a_word():
    """Prefixes end before a space, where every pre-tokenizer that splits at spaces ends a word:
    a metaspace keeps tabs and no-break spaces inside its words, and its unigram model chooses a
    run's first pieces by where the run ends, so a cut at other whitespace would change them.
    A byte-level BPE whose merges chain a word of 80 characters from its end, without a space in
    it, is tokenized whole. A tokenizer that does not split at spaces is tokenized whole, once."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    from dflash_core.data.tokenize import splits_at_spaces

    def same_as_whole(tok, content: str, kept: int) -> None:
        conv = Conversation([{"role": "assistant", "content": content}], "mem:1")
        whole = encode_conversation(tok.inner, conv)
        doc = encode_conversation(tok, conv, max_tokens=kept)
        assert np.array_equal(doc.input_ids, whole.input_ids[:kept]), (kept, doc.input_ids[:8], whole.input_ids[:8])
        assert np.array_equal(doc.loss_mask, whole.loss_mask[:kept])

    pieces = [("<unk>", -20.0), ("<|im_end|>", 0.0), ("\u2581", -1.0), ("\u2581x", -1.0), ("y", -1.0)]
    pieces += [(f"x{w}", -1.0) for w in "\t\u00a0"] + [(f"{w}x", -1.0) for w in "\t\u00a0"]
    pieces += [("x", -10.0), ("\t", -10.0), ("\u00a0", -10.0), ("assistant:", -1.0)]
    metaspace = Tokenizer(models.Unigram(pieces, unk_id=0))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok = _wrapped(metaspace)
    assert splits_at_spaces(tok)
    for space in "\t\u00a0":
        for kept in (1, 2, 3, 7, 20, 50):
            same_as_whole(tok, f"x{space}" * 2000 + "y z", kept)

    # merges from the word's end: its first token depends on where it ends
    chars = [c for i in range(40) for c in ("!#$%&*+-/<=>?@^|~"[i % 17], "\x1c\x1d"[i // 17 % 2])]
    vocab = {c: i for i, c in enumerate(sorted(set(chars)))}
    merges = []
    for a, b in reversed(list(itertools.pairwise(chars))):
        if (a, b) not in merges:
            merges.append((a, b))
            vocab.setdefault(a + b, len(vocab))
    vocab.update({"<|im_end|>": len(vocab), "<unk>": len(vocab) + 1})
    bpe = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    gpt_split = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    bpe.pre_tokenizer = pre_tokenizers.Split(Regex(gpt_split), behavior="isolated")
    tok = _wrapped(bpe)
    tok.inner.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for kept in (1, 2):
        same_as_whole(tok, "".join(chars), kept)

    bpe.pre_tokenizer = pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated")  # digits alone
    assert not splits_at_spaces(_wrapped(bpe))
    # a split on spaces behind a normalizer that leaves none (Gemma's): it splits nothing
    bpe.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    assert splits_at_spaces(_wrapped(bpe))
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    assert not splits_at_spaces(_wrapped(bpe))
    bpe.normalizer = None
    bpe.pre_tokenizer = None
    tok = _wrapped(bpe)
    text = "! # " * 500
    doc = encode_conversation(tok, Conversation([{"role": "assistant", "content": text}], "mem:1"), max_tokens=3)
    assert not splits_at_spaces(tok) and doc.cut and len(tok.lengths) == 1 and tok.lengths[0] > len(text)


def _check_prefix_tokens(tok: _RecordingTokenizer, answer: str, kept: int, longest_word: int) -> None:
    """encode_conversation with max_tokens=kept gives the whole text's first tokens and mask, from
    prefixes no longer than a few times the kept tokens' characters and the longest word."""
    conv = Conversation([{"role": "user", "content": "go"}, {"role": "assistant", "content": answer}], "mem:1")
    whole = encode_conversation(tok.inner, conv)
    tok.lengths.clear()
    doc = encode_conversation(tok, conv, max_tokens=kept)
    assert doc.cut and len(doc.input_ids) == kept
    assert np.array_equal(doc.input_ids, whole.input_ids[:kept])
    assert np.array_equal(doc.loss_mask, whole.loss_mask[:kept]) and doc.loss_mask.any()
    # doubling until a prefix reaches past the word its cut fell in
    assert max(tok.lengths) <= 4 * (16 * kept + longest_word) < len(answer) // 2, tok.lengths
    # a record within its bound is tokenized whole and not counted as cut
    short = encode_conversation(tok, conv, max_tokens=len(whole.input_ids))
    assert not short.cut and np.array_equal(short.input_ids, whole.input_ids)
    assert np.array_equal(short.loss_mask, whole.loss_mask)


def test_a_long_record_is_tokenized_from_prefixes_with_the_tokens_of_the_whole():
    """A record far longer than the tokens kept: only prefixes are tokenized, and the tokens and
    mask kept are the whole text's first ones. Byte-level BPE over words, digit runs, runs of
    spaces and newlines, accented letters and words thousands of characters long, so that a
    prefix's cut falls inside every kind of piece; and a unigram model where the cut changes the
    kept tokens themselves until a prefix reaches past the run it cut."""
    tok = _RecordingTokenizer("bpe")
    pieces = ["the", "red", "dog", "12345", "café", "   ", "\n\n", ";", "ünïcode", "x" * 3000, "ab" * 1500]
    p = [0.14, 0.14, 0.14, 0.1, 0.1, 0.1, 0.1, 0.1, 0.076, 0.002, 0.002]
    for seed in range(2):
        answer = " ".join(np.random.default_rng(seed).choice(pieces, size=8_000, p=p).tolist())
        for kept in (64, 700):
            _check_prefix_tokens(tok, answer, kept, 3000)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        encode_conversation(tok, Conversation([{"role": "assistant", "content": "a " * 9000}], "x:1"), max_tokens=0)
    tok = _RecordingTokenizer("unigram")
    for run in (5000, 5001, 5002):
        for kept in (48, 64, 96):  # 48 and 96: prefixes of 16 and 32 times kept agree on a cut run
            _check_prefix_tokens(tok, "a" * run + " b" * 30_000, kept, run)


def _bos_byte_bpe():
    """A byte-level BPE over every byte (whitespace of every kind kept as tokens) whose post-processor
    adds a BOS: tokens differ where special tokens are added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["the red dog\n\tran  far;\r\n café 12345"] * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>")


def test_tokens_from_the_backend_are_the_tokenizers_own(target_tokenizer):
    """Where the tokenizer's call is transformers' own, its tokens and offsets come from its
    backend directly, the same as the call gives: byte-level BPE (with and without whitespace
    tokens and a BOS its post-processor adds), unigram and the embedded target's tokenizer,
    special tokens in the text included. A backend the call would first change (truncation or
    padding set, special tokens split), or a class that overrides the call, is left to the call."""
    from transformers import PreTrainedTokenizerFast

    from dflash_core.data.tokenize import _plain_backend, _tokens

    texts = ["", "the red dog<|im_end|>\n", "naïve café  12345\n\n;x", "<|im_end|><|im_end|> ab" * 40]
    texts += [" \t the\r\n\n  dog \u00a0 ran\t\t", "\n"]
    tokenizers = [_RecordingTokenizer("bpe").inner, _RecordingTokenizer("unigram").inner, target_tokenizer]
    for tok in tokenizers + [_bos_byte_bpe()]:
        assert _plain_backend(tok) is not None, type(tok)
        vocab = [t for t in tok.convert_ids_to_tokens(list(range(min(40, len(tok))))) if t]
        for text in texts + ["user: " + " ".join(vocab)]:
            ids, offsets = _tokens(tok, text)
            call = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            assert ids.tolist() == call["input_ids"] and offsets.tolist() == [list(o) for o in call["offset_mapping"]]
    bos = _bos_byte_bpe()
    assert len(_tokens(bos, texts[4])[0]) > 8  # the whitespace is tokens here, and no BOS was added
    tok = _RecordingTokenizer("bpe").inner
    tok.backend_tokenizer.enable_truncation(3)
    assert _plain_backend(tok) is None and len(_tokens(tok, texts[1])[0]) > 3
    tok.split_special_tokens = True
    assert _plain_backend(tok) is None
    ids, _ = _tokens(tok, texts[1])
    assert tok.convert_tokens_to_ids("<|im_end|>") not in ids.tolist()
    tok = _RecordingTokenizer("bpe").inner
    tok.backend_tokenizer.enable_padding(length=64)
    assert _plain_backend(tok) is None and len(_tokens(tok, texts[1])[0]) < 64

    class Overriding(PreTrainedTokenizerFast):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    assert _plain_backend(Overriding(tokenizer_object=bos.backend_tokenizer, eos_token="<|im_end|>")) is None
