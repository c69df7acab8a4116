"""How a decode step chooses its tokens: greedy, or Gumbel-max sampling with counter-based noise.

The noise of a token is a hash of the sequence's own seed, its position among the generated
tokens and the vocabulary index (Gumbel-max over the temperature-scaled, top-k / top-p filtered
logits), so a sequence's output depends on its seed alone, never on the slot, the batch or a
restart. Temperature 0 is greedy (argmax, as `generate`). Sampling from the whole distribution
(no top-k, no top-p) needs no sort, nor does a top-k up to STATIC_TOP_K (each row's k largest are
picked), nor on CUDA top-p alone (each row's floor found by bisection, kernels/top_p.py); each
mode (Sampling.mode) is its own recorded step of the decoder (decode.py), and on CUDA the noise,
the sum and the argmax are one kernel (kernels/gumbel_max.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from ..kernels import runs_on

log = logging.getLogger("dflash.generate")

M32 = 0xFFFFFFFF  # the hash works on 32-bit values: seeds keep their low 32 bits
# up to this top_k a sampled step picks each row's k largest logits (torch.topk, its k a shape of
# the recorded step) in place of sorting the whole row, which costs several passes over
# [slots, vocabulary]; past it the sort
STATIC_TOP_K = 1024


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy; top_k 0 and top_p 1 disable those
    filters. Stop tokens end a sequence (kept in its output); ignore_stop decodes through them
    (benchmarks)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_stop: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def mode(self) -> str:
        """Each mode its own recorded step: greedy; sample (from the whole temperature-scaled
        distribution); top-<k> (top_k up to STATIC_TOP_K, then top_p: the k largest of each row
        picked, not the row sorted); top-p (top_p alone: each row's floor, or the row sorted
        where the kernels do not run); filtered (a larger top_k: every row sorted)."""
        if self.greedy:
            return "greedy"
        if 0 < self.top_k <= STATIC_TOP_K:
            return f"top-{self.top_k}"
        if self.top_k > 0:
            return "filtered"
        return "top-p" if self.top_p < 1 else "sample"


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values below 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [N, vocab] that depends only on each row's (seed, step) and the index."""
    base = _mix32((_mix32(seeds & M32) + steps) & M32).unsqueeze(-1)
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64).unsqueeze(0)
    h = _mix32((base ^ _mix32((idx * 0x9E3779B9) & M32)) & M32)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def choose_tokens(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    mode: str,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    kernel: bool = False,
    floor_kernel: bool = False,
) -> torch.Tensor:
    """The next token of each row of logits [N, V] in a Sampling.mode: argmax when greedy, else
    Gumbel-max over the logits scaled by 1/temperature (fp32), in the top-<k> and filtered modes
    cut to the top_k largest (0: all) and then to the smallest set whose probability reaches top_p
    (the order transformers applies them in). kernel: the noise, the sum and the argmax in one
    Triton kernel (kernels/gumbel_max.py), the same tokens. floor_kernel (with kernel): in the
    top-p mode each row's cut as a floor found without a sort (kernels/top_p.py), the same tokens
    but where a sum's rounding puts a token on the other side of top_p."""
    if mode == "greedy":
        return logits.argmax(dim=-1)
    if mode == "top-p" and kernel and floor_kernel:
        from ..kernels.gumbel_max import gumbel_argmax
        from ..kernels.top_p import top_p_floor

        return gumbel_argmax(logits, temperature, seeds, steps, top_p_floor(logits, temperature, top_p))
    if mode in ("filtered", "top-p"):
        logits = keep_top(logits.float() / temperature, top_k, top_p)
        temperature = torch.ones_like(temperature)  # already scaled: x / 1 is x
    elif mode.startswith("top-"):
        logits = keep_top_k(logits.float() / temperature, int(mode.removeprefix("top-")), top_p)
        temperature = torch.ones_like(temperature)
    if kernel:
        from ..kernels.gumbel_max import gumbel_argmax

        return gumbel_argmax(logits, temperature, seeds, steps)
    return (logits.float() / temperature + gumbel_noise(seeds, steps, logits.shape[-1])).argmax(dim=-1)


@functools.cache
def sample_kernel_matches(device: str) -> bool:
    """Whether the sampling kernel (kernels/gumbel_max.py) runs on `device` and draws there the
    tokens of the torch ops it replaces, probed once per device: where it fails to build or
    differs, sampling stays with the torch ops."""
    if not runs_on(torch.device(device)):
        return False
    logits, seeds, steps, temperature = _probe_rows(device)
    try:
        from ..kernels.gumbel_max import gumbel_argmax

        got = gumbel_argmax(logits, temperature, seeds, steps)
    except Exception as e:  # noqa: BLE001 - a kernel that fails here leaves the torch ops
        log.warning("the sampling kernel failed its probe on %s (%s); sampling runs as torch ops", device, e)
        return False
    want = (logits.float() / temperature + gumbel_noise(seeds, steps, logits.shape[-1])).argmax(dim=-1)
    same = torch.equal(got, want)
    if not same:
        log.warning("the sampling kernel's tokens differ from the torch ops' on %s; sampling runs as torch ops", device)
    return same


@functools.cache
def floor_kernel_matches(device: str) -> bool:
    """Whether the top-p floor (kernels/top_p.py) runs on `device` and draws there, with the
    sampling kernel, the tokens of the sorted cut, probed once per device: where it fails to
    build or differs, top-p alone sorts (the sampling kernel stays, probed on its own)."""
    if not sample_kernel_matches(device):
        return False
    logits, seeds, steps, temperature = _probe_rows(device)
    top_k, top_p = torch.zeros_like(seeds[:1]), torch.full_like(temperature, 0.9)
    try:
        got = choose_tokens(logits, seeds, steps, "top-p", temperature, top_k, top_p, kernel=True, floor_kernel=True)
    except Exception as e:  # noqa: BLE001 - a kernel that fails here leaves the sort
        log.warning("the top-p kernel failed its probe on %s (%s); top-p sorts", device, e)
        return False
    same = torch.equal(got, choose_tokens(logits, seeds, steps, "top-p", temperature, top_k, top_p, kernel=True))
    if not same:
        log.warning("the top-p kernel's tokens differ from the sorted cut's on %s; top-p sorts", device)
    return same


def _probe_rows(device: str) -> tuple[torch.Tensor, ...]:
    """What the kernels' probes sample from: bf16 logits over several of their blocks (the last
    one partial), seeds, steps and a temperature."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 9001, generator=gen) * 3).to(device, torch.bfloat16)
    seeds, steps = torch.arange(4, device=device) * 7919 + 1, torch.arange(4, device=device) + 3
    return logits, seeds, steps, torch.tensor([0.7], device=device)


def keep_top_k(scaled: torch.Tensor, k: int, top_p: torch.Tensor) -> torch.Tensor:
    """keep_top for a top_k of k, from each row's k largest (torch.topk: no sort of the row)."""
    k = min(k, scaled.shape[-1])  # a top_k past the vocabulary keeps all of it
    values, order = scaled.topk(k, dim=-1)  # largest first, as the sort's first k
    kept = values.masked_fill(~nucleus(values, top_p), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, kept)


def keep_top(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """scaled [N, V] with -inf outside each row's top_k largest (0: all) and then outside the
    smallest set of those whose probability reaches top_p."""
    vocab = scaled.shape[-1]
    values, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab)
    values = values.masked_fill(rank >= k, float("-inf"))
    keep_sorted = nucleus(values, top_p) & (rank < k)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf"))


def nucleus(values: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Of values [N, K] sorted largest first, the smallest prefix of each row whose probability
    (softmax over the row) reaches top_p, equal values kept or cut together; the first always."""
    probs = values.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    rank = torch.arange(values.shape[-1], device=values.device)
    # a tie takes the probability above the first of its values: strictly more probable tokens
    # only, as the top-p kernel's floor counts it, whichever order the sort left the tie in
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[:, 1:] = values[:, 1:] != values[:, :-1]
    first = torch.where(starts, rank, 0).cummax(dim=-1).values
    return (before.gather(-1, first) < top_p) | (rank == 0)
