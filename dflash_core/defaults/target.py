"""The embedded default target: a tiny Qwen3-architecture model trained deterministically on the
synthetic language (a few hundred CPU steps), so its greedy answers carry real structure."""

from __future__ import annotations

import time
from pathlib import Path

import torch

TINY_TARGET = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_qwen3_config(vocab_size: int, **overrides):
    from transformers import Qwen3Config

    kw = dict(TINY_TARGET, vocab_size=vocab_size, **overrides)
    cfg = Qwen3Config(**kw)
    return cfg


def _lm_batches(tokenizer, conversations, batch_size: int, seq_len: int, rng: torch.Generator):
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:seq_len] for t in texts]
    pad = tokenizer.pad_token_id
    while True:
        order = torch.randperm(len(ids), generator=rng).tolist()
        for i in range(0, len(order) - batch_size + 1, batch_size):
            rows = [ids[j] for j in order[i : i + batch_size]]
            width = max(len(r) for r in rows)
            x = torch.full((batch_size, width), pad, dtype=torch.long)
            m = torch.zeros((batch_size, width), dtype=torch.long)
            for k, r in enumerate(rows):
                x[k, : len(r)] = torch.tensor(r)
                m[k, : len(r)] = 1
            yield x, m


def build_tiny_target(tokenizer, conversations, out_dir: str | Path, *, steps: int, seed: int, log=print) -> Path:
    """Train a tiny Qwen3 on full conversations (next-token loss) and save it with the tokenizer."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_qwen3_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(cfg).float()
    if steps:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
        batches = _lm_batches(tokenizer, conversations, 32, 192, torch.Generator().manual_seed(seed))
        start = time.time()
        model.train()
        for step in range(steps):
            x, m = next(batches)
            labels = x.masked_fill(m == 0, -100)
            loss = model(input_ids=x, attention_mask=m, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 50 == 0 or step == steps - 1:
                log(f"tiny target step {step}/{steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
