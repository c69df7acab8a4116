"""Hand-written Triton kernels for the CUDA step: the two-pass cross-entropy of a loss chunk
(`ce`), the AdamW update over fp32 masters with bf16 working copies (`adamw`), and for the
regeneration decoder the attention of one query per slot over its valid cache positions
(`decode_attention`), the target's RMSNorms (`rms_norm`) and rotary embeddings (`rope`), the
decode step's cache writes (`slot_write`), a sampled step's tokens (`gumbel_max`) and its top-p
cut (`top_p`). They import Triton at module import; callers import them lazily so CPU-only
installs without Triton work."""

import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # read once, as Triton reads it


def runs_on(device: torch.device) -> bool:
    """Whether these kernels launch on `device`: CUDA, or the CPU through Triton's interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED)
