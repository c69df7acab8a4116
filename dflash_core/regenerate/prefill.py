"""How the slot decoder (decode.SlotDecoder) puts prompts into its cache: in chunks of similar
width under a token budget, each chunk one forward of its prompts right-padded to its widest,
and per layer kind the attention that forward takes (attention.py says how it travels).

Right padding is what lets most layers attend without a mask: a prompt's query at position i
sees positions 0..i, all its own tokens, and the padding at the right is seen by padding queries
only, whose outputs nobody reads (the logits are taken at each prompt's last token; the padded
positions' keys go into the cache too, but a slot's decode step writes each position before any
query of that slot sees it). A sliding layer also drops the keys at i - window and before, which
matters only once a chunk is wider than the window.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .attention import prefill_causal


def chunk_bounds(widths: list[int], budget: int) -> Iterator[tuple[int, int]]:
    """[start, end) of consecutive chunks of the prompts of `widths` (sorted by width, the chunks
    come out even), each as many prompts as fit `budget` tokens once padded to the chunk's widest,
    at least one."""
    start = 0
    while start < len(widths):
        width, end = widths[start], start + 1
        while end < len(widths) and (end - start + 1) * max(width, widths[end]) <= budget:
            width = max(width, widths[end])
            end += 1
        yield start, end
        start = end


def padded_prompts(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts right-padded with token 0 to the widest: ids [N, W], positions [N, W] (0..W-1 in
    every row, padding included) and lengths [N], on `device`."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    positions = torch.arange(width, device=device).unsqueeze(0).expand(len(prompts), -1)
    return ids.to(device), positions, lengths.to(device)


def prefill_attention(kinds: list[str], window: int | None, width: int, device) -> dict[str, torch.Tensor]:
    """Per layer kind, what the attention of a chunk `width` wide takes in place of its mask: the
    causal marker, or for a sliding layer narrower than the chunk a boolean mask [1, 1, W, W] (True
    where the query at i sees the key at j: i - window < j <= i), the same for every prompt."""
    out = {}
    for kind in dict.fromkeys(kinds):
        if kind == "sliding_attention" and window and width > int(window):
            pos = torch.arange(width, device=device)
            behind = pos.view(-1, 1) - pos.view(1, -1)  # query position - key position
            out[kind] = ((behind >= 0) & (behind < int(window))).view(1, 1, width, width)
        else:
            out[kind] = prefill_causal(device)
    return out
