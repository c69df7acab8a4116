"""Conversation parsing, loss masks, fixed-shape packing and anchor coverage."""

import copy
import dataclasses
import json

import numpy as np
import pytest

from dflash_core.config import ShapeConfig
from dflash_core.data.anchors import valid_anchor_positions
from dflash_core.data.batches import MicroBatchStream
from dflash_core.data.conversations import DatasetError, ReadReport, read_conversations
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
