"""Rebuild the bundled default assets (tokenizer, tiny trained target, datasets) from scratch.

    python -m dflash_core.defaults.build [--out dflash_core/defaults/assets] [--steps 600]

Deterministic for fixed seeds on a given torch build; takes a few minutes on 2 CPU cores. The
dataset's assistant turns are the tiny target's own greedy answers, as the DFlash recipe
regenerates training data with the target.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from .synthetic import corpus_words, make_conversations
from .target import build_tiny_target
from .tokenizer import build_tokenizer


@torch.no_grad()
def regenerate_with_target(model, tokenizer, conversations, batch_size: int = 64, max_new_tokens: int = 64):
    """Replace every assistant turn by the target's greedy reply, turn by turn, in batches."""
    tokenizer.padding_side = "left"
    out = [list(c) for c in conversations]
    max_turns = max(sum(m["role"] == "assistant" for m in c) for c in conversations)
    for turn in range(max_turns):
        jobs = []  # (conversation index, message index)
        for ci, conv in enumerate(out):
            idx = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
            if turn < len(idx):
                jobs.append((ci, idx[turn]))
        for b in range(0, len(jobs), batch_size):
            chunk = jobs[b : b + batch_size]
            prompts = [
                tokenizer.apply_chat_template(out[ci][:mi], tokenize=False, add_generation_prompt=True)
                for ci, mi in chunk
            ]
            enc = tokenizer(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            for (ci, mi), row in zip(chunk, gen[:, enc["input_ids"].shape[1] :].tolist()):
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id)]
                out[ci][mi] = {"role": "assistant", "content": tokenizer.decode(row, skip_special_tokens=True).strip()}
    tokenizer.padding_side = "right"
    return out


def write_jsonl(path: Path, conversations) -> None:
    with path.open("w", encoding="utf-8") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).parent / "assets"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--train-conversations", type=int, default=2000)
    p.add_argument("--heldout-conversations", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "target").mkdir(parents=True)
    build_tokenizer(corpus_words(), tmp / "target")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp / "target"))
    start = time.time()
    build_tiny_target(tokenizer, make_conversations(6000, seed=0), tmp / "target", steps=args.steps, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "target")).eval()
    train = regenerate_with_target(model, tokenizer, make_conversations(args.train_conversations, seed=1))
    heldout = regenerate_with_target(model, tokenizer, make_conversations(args.heldout_conversations, seed=2))
    write_jsonl(tmp / "train.jsonl", train)
    write_jsonl(tmp / "heldout.jsonl", heldout)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"built default assets in {out} ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
