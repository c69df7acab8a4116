"""Dataset preparation throughput (CPU): tokens per second per core through the daemon's own path
(dflash_core.data.prepare: read, chat template, tokenize, loss mask, write the cache), the time
to open the cache again, and what both mean for a 1 B-token dataset on a 16-core host.

    python -m bench.tokenize_throughput [--megabytes 64] [--workers 1,2] [--vocab 150000]

The tokenizer is a byte-level BPE with a 150K vocabulary (the size of Qwen3's) trained here with
`tokenizers` on synthetic text, wrapped as a transformers tokenizer with a Qwen-style chat
template; the conversations are synthetic too (several turns, long assistant answers). Writes
$OUT/tokenize_throughput.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TARGET_TOKENS = 1_000_000_000
TARGET_CORES = 16


def words(rng: random.Random, n: int) -> str:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "pe", "qua", "dor", "lin", "mar", "tos"]
    out = []
    for _ in range(n):
        w = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        out.append(w if rng.random() > 0.1 else w + rng.choice([",", ".", "?", "!", "\n"]))
    return " ".join(out)


def make_tokenizer(directory: Path, vocab: int, rng: random.Random) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False
    )
    letters = "abcdefghijklmnopqrstuvwxyzäöüéèàçñ"

    def rare() -> str:  # enough distinct strings for the merges of a large vocabulary
        return "".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))

    corpus = [words(rng, 150) + " " + " ".join(rare() for _ in range(60)) for _ in range(40_000)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(directory))
    return directory


def make_dataset(path: Path, megabytes: int, rng: random.Random) -> int:
    size = 0
    with path.open("w") as f:
        while size < megabytes << 20:
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns.append({"role": "user", "content": words(rng, rng.randint(10, 60))})
                turns.append({"role": "assistant", "content": words(rng, rng.randint(100, 600))})
            line = json.dumps({"messages": turns}) + "\n"
            f.write(line)
            size += len(line)
    return size


def main(argv=None) -> None:
    # imported here, not at the top: spawned tokenizer workers import this module again, and
    # bench.common imports torch
    from transformers import AutoTokenizer

    from bench.common import out_dir, print_table
    from dflash_core.config import ShapeConfig
    from dflash_core.data.batches import MicroBatchStream
    from dflash_core.data.prepare import Tokenization, prepare_corpus, save_tokenizer
    from dflash_core.data.tokenize import ChatTemplate

    p = argparse.ArgumentParser()
    p.add_argument("--megabytes", type=int, default=64)
    p.add_argument("--workers", default=f"1,{os.cpu_count()}")
    p.add_argument("--vocab", type=int, default=150_000)
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--work", default="/tmp/dflash-tokenize-bench")
    p.add_argument("--tokenizer", help="a tokenizer directory made by an earlier run (skips training the BPE)")
    args = p.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = random.Random(0)
    t = time.perf_counter()
    tok_dir = Path(args.tokenizer) if args.tokenizer else make_tokenizer(work / "tokenizer", args.vocab, rng)
    train_s = time.perf_counter() - t
    data = work / "data.jsonl"
    size = make_dataset(data, args.megabytes, rng)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    shape = ShapeConfig(seq_len=args.seq_len, num_anchors=512, block_size=16)
    rows, record = [], {"args": vars(args), "vocab": len(tokenizer), "bytes": size, "bpe_train_s": round(train_s, 1)}
    for workers in (int(w) for w in args.workers.split(",")):
        cache = work / f"cache-{workers}"
        directory, digest = save_tokenizer(tokenizer, cache)
        tok = Tokenization(str(directory), digest, ChatTemplate(), args.seq_len)
        t = time.perf_counter()
        corpus = prepare_corpus([str(data)], tok, cache, workers=workers)
        cold = time.perf_counter() - t
        tokens = int(corpus.lengths.sum())
        t = time.perf_counter()
        warm_corpus = prepare_corpus([str(data)], tok, cache, workers=workers)
        MicroBatchStream(warm_corpus, shape, 0, seed=0).get(0)  # what a job does before its first step
        warm = time.perf_counter() - t
        per_core = tokens / cold / workers
        rows.append(
            {
                "workers": workers,
                "documents": len(corpus),
                "tokens": tokens,
                "cold_s": round(cold, 2),
                "tokens_per_s": round(tokens / cold),
                "tokens_per_s_per_core": round(per_core),
                "warm_open_s": round(warm, 3),
                f"1B_tokens_cold_min_on_{TARGET_CORES}_cores": round(TARGET_TOKENS / (per_core * TARGET_CORES) / 60, 1),
                "1B_tokens_warm_open_s": round(warm * TARGET_TOKENS / tokens, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    record["rows"] = rows
    out = out_dir()
    (out / "tokenize_throughput.json").write_text(json.dumps(record, indent=1))
    print(
        f"\nDataset preparation, {size >> 20} MiB JSONL, BPE vocabulary {len(tokenizer)}, {os.cpu_count()} cores here; "
        f"1 B-token figures extrapolate per-core throughput to {TARGET_CORES} cores"
    )
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
