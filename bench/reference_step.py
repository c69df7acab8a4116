"""The public reference's drafter training step, for the side-by-side row of bench.drafter_step.

The model is z-lab's `DFlashDraftModel` (`dflash/model.py` of github.com/z-lab/dflash), imported
from a checkout the user names with `--reference-src` (a clone of that repository, or the file
itself); it is not part of this repository and nothing of it is copied here. It is trained the way
SpecForge's `OnlineDFlashModel` trains it (specforge/algorithms/common/dflash_family_model.py):
bf16 weights, transformers' flex_attention backend with a BlockMask over the context (keys before
the block's anchor) and the block's own draft keys, the noise block's first token the anchor's, the
others the mask token, RoPE over context then draft positions, and the loss in chunks of 128 blocks
(lm_head, cross-entropy against tokens anchor+1.., weighted with the position decay of gamma 7,
each chunk recomputed in the backward under activation checkpointing), divided by the weights'
sum. Not timed: SpecForge's sampling of the anchors, which our micro-batch brings.

It runs on the same micro-batch as our step: the same anchors, target features, embedding and
lm_head. Our micro-batch packs documents and our mask keeps each block inside its document;
SpecForge's mask has no documents, so its blocks see a little more context (a few % more
attention FLOPs): the row's milliseconds are the reference's step, not a FLOP-for-FLOP twin.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CHUNK_BLOCKS = 128  # SpecForge's objective_chunk_blocks default
LOSS_DECAY_GAMMA = 7.0


def load_reference_model_module(src: str):
    """z-lab's dflash/model.py, from a checkout of the repository or the file's path."""
    path = Path(src)
    if path.is_dir():
        path = path / "dflash" / "model.py"
    if not path.is_file():
        raise FileNotFoundError(f"--reference-src: no z-lab dflash model file at {path}")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_model(src: str, cfg, device: str = "cuda:0"):
    """DFlashDraftModel built from the config.json our checkpoints carry for it (so the same
    shape, RoPE and layer types as our drafter), bf16, flex_attention."""
    from transformers import Qwen3Config

    from dflash_core.checkpoint import hf_config

    qcfg = Qwen3Config(**hf_config(cfg, torch.bfloat16))
    qcfg._attn_implementation = "flex_attention"
    module = load_reference_model_module(src)
    with torch.device(device):
        model = module.DFlashDraftModel(qcfg)
    return model.to(device=device, dtype=torch.bfloat16).train()


def specforge_block_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block: int):
    """The BlockMask of SpecForge's DFlash training for one sequence: a draft query of block b sees
    the context keys before b's anchor and the draft keys of block b, for kept blocks only."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = anchors.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block
        safe = q_block.clamp(max=n - 1)
        context = (kv_idx < seq_len) & (kv_idx < anchors[safe])
        draft = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block == q_block)
        return (context | draft) & keep[safe] & (q_block < n)

    return create_block_mask(mask_mod, B=1, H=None, Q_LEN=n * block, KV_LEN=seq_len + n * block, device=anchors.device)


class ReferenceStep:
    """One forward + backward of the reference on a micro-batch (`__call__`), from zero grads."""

    def __init__(self, src: str, cfg, head, batch, feats, mask_each_step: bool = True):
        self.model = reference_model(src, cfg)
        self.mask_each_step = mask_each_step
        self.cfg, self.head, self.batch = cfg, head, batch
        self.feats = feats.unsqueeze(0)
        block, seq_len = cfg.block_size, batch.input_ids.shape[0]
        anchors, keep = batch.anchors, batch.anchor_valid
        offsets = torch.arange(block, device=anchors.device)
        label_pos = anchors[:, None] + offsets[None, :]  # [N, block]
        in_bounds = label_pos < seq_len
        safe = label_pos.clamp(max=seq_len - 1)
        self.target_ids = batch.input_ids[safe]
        weight = keep[:, None] & in_bounds & (offsets[None, :] > 0) & batch.loss_mask[safe]
        # SpecForge's loss_decay_gamma (7 in its Qwen3-8B recipe, as our step's gamma)
        decay = torch.exp(-(offsets - 1).clamp(min=0).float() / LOSS_DECAY_GAMMA)
        self.weight = weight.float() * decay[None, :]
        noise = torch.full((anchors.shape[0], block), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
        noise[:, 0] = torch.where(keep, batch.input_ids[anchors.clamp(max=seq_len - 1)], cfg.mask_token_id)
        self.noise_ids = noise.reshape(1, -1)
        context_pos = torch.arange(seq_len, device=anchors.device)
        self.position_ids = torch.cat([context_pos, label_pos.reshape(-1)]).unsqueeze(0)
        self.anchors, self.keep, self.seq_len = anchors, keep, seq_len
        self.mask = None if mask_each_step else self.block_mask()

    def block_mask(self):
        return specforge_block_mask(self.anchors, self.keep, self.seq_len, self.cfg.block_size)

    def _chunk_terms(self, hidden, target_ids, weight):
        logits = F.linear(hidden, self.head.lm_head_weight)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target_ids.reshape(-1), reduction="none")
        with torch.no_grad():
            correct = ((logits.argmax(-1) == target_ids) & (weight > 0.5)).sum().float()
        return (ce.reshape_as(target_ids) * weight).sum(), weight.sum(), correct

    def __call__(self) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        self.model.zero_grad(set_to_none=True)
        # SpecForge builds the mask in every forward (its anchors change per batch)
        mask = self.block_mask() if self.mask is None else self.mask
        noise = F.embedding(self.noise_ids, self.head.embed_weight)
        out = self.model(
            position_ids=self.position_ids, noise_embedding=noise, target_hidden=self.feats, attention_mask=mask
        )
        hidden = out.reshape(self.anchors.shape[0], self.cfg.block_size, -1)
        num = den = None
        for start in range(0, hidden.shape[0], CHUNK_BLOCKS):
            sl = slice(start, start + CHUNK_BLOCKS)
            n_, d_, _ = checkpoint(
                self._chunk_terms, hidden[sl], self.target_ids[sl], self.weight[sl], use_reentrant=False
            )
            num, den = (n_, d_) if num is None else (num + n_, den + d_)
        loss = num / den
        loss.backward()
        return loss.detach()


def bench_reference(src: str, cfg, head, batch, feats, iters: int, variant: str = "reference") -> dict:
    """The reference's row: median and min ms of forward + backward, first call, memory.
    variant "reference" builds its BlockMask in every step, as SpecForge does;
    "reference_mask_once" builds it once, outside the clock (the model and loss alone)."""
    from bench.common import cuda_time_ms, timing_fields

    step = ReferenceStep(src, cfg, head, batch, feats, mask_each_step=variant == "reference")
    t0 = time.perf_counter()
    loss = step()  # compiles transformers' flex_attention before the clocks
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = cuda_time_ms(step, warmup=2, iters=iters)
    return {
        "variant": variant,
        **timing_fields(times),
        "first_call_s": round(first_call_s, 1),
        "loss": round(float(loss), 4),
    }
