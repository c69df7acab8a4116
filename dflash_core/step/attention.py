"""The DFlash training mask and the two attention paths that apply it.

KV layout of one micro-batch: [context (S tokens) | block_0 | block_1 | ... | block_{N-1}],
queries: all blocks (Q = N * B). A query of block j with anchor a_j sees
  * context position p  iff  doc[p] == doc[a_j] and p < a_j  (strictly before the anchor),
  * every position of its own block (bidirectional),
and nothing else. Padding blocks (anchor_valid false) see only their own block, so their rows
are never empty (no NaN) and their loss weight is zero.

A sliding-window drafter (DrafterConfig.sliding_window = W; SpecForge's sliding DFlash mask,
`create_dflash_block_mask` / `create_dflash_sdpa_mask`) narrows both: the query at block offset o
(position a_j + o) sees context positions p >= a_j + o - (W - 1) (the query itself takes one
slot of the window) and the positions of its own block at offsets <= o.

One `mask_mod` defines the rule; `flex` turns it into a BlockMask for compiled flex_attention
(CUDA), `dense` evaluates it into a boolean [Q, KV] matrix for SDPA (CPU: flex has no backward
there). Tests check that both compute the same function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def context_intervals(
    doc_ids: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: the context interval [lo, hi) its queries see. Packing lays every document out
    as one contiguous run (pack_documents), so "same document as the anchor and before it" is
    [start of the anchor's run, anchor). Padding blocks get the empty interval [0, 0)."""
    pos = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    run_starts = torch.ones_like(doc_ids, dtype=torch.bool)
    run_starts[1:] = doc_ids[1:] != doc_ids[:-1]
    run_start_of = torch.cummax(torch.where(run_starts, pos, torch.zeros_like(pos)), dim=0).values
    zero = torch.zeros_like(anchors)
    return torch.where(anchor_valid, run_start_of[anchors], zero), torch.where(anchor_valid, anchors, zero)


def dflash_mask_mod(
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    queries_per_batch: int = 0,
    sliding_window: int | None = None,
) -> MaskMod:
    """The visibility rule as a flex_attention mask_mod (also evaluable by broadcasting).

    Written with per-block context intervals (`context_intervals`) rather than as
    `doc[kv] == doc[anchor]`: the kernel then loads two numbers per query row and nothing per
    key, where a per-element document gather makes the flex backward several times slower.
    tests/test_mask.py checks it against the element-wise rule (docs/design.md) on random
    packings.
    queries_per_batch > 0: the queries are split into batch entries of that many (see
    FlexAttention.q_splits); query q_idx of entry b is query b * queries_per_batch + q_idx."""
    num_anchors = anchors.shape[0]
    lo, hi = context_intervals(doc_ids, anchors, anchor_valid)

    def mask_mod(b, h, q_idx, kv_idx):
        if queries_per_batch:
            q_idx = b * queries_per_batch + q_idx
        block = torch.clamp(q_idx // block_size, max=num_anchors - 1)
        sees_context = (kv_idx >= lo[block]) & (kv_idx < hi[block])  # hi <= anchor < seq_len
        own_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == block)
        if sliding_window is not None:
            offset = q_idx % block_size
            sees_context = sees_context & (kv_idx >= hi[block] + offset - (sliding_window - 1))
            own_block = own_block & ((kv_idx - seq_len) % block_size <= offset)
        return sees_context | own_block

    return mask_mod


def dense_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device | str) -> torch.Tensor:
    """Evaluate a mask_mod on the full [q_len, kv_len] grid (True = may attend)."""
    q_idx = torch.arange(q_len, device=device).view(-1, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, -1)
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(zero, zero, q_idx, kv_idx).expand(q_len, kv_len)


@dataclass
class DenseAttention:
    """SDPA with a boolean mask; `mask=None` means every query sees every key."""

    mask: torch.Tensor | None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, Hq, Q, D], k/v: [1, Hkv, KV, D]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            # Explicit repeat rather than enable_gqa: the math kernel on CPU and older torch lack it.
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        mask = None if self.mask is None else self.mask.view(1, 1, *self.mask.shape)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# the dense-mask attentions by kind: the engine's "dense"; benchmarks add their baselines here
DENSE_KINDS: dict[str, Callable[[torch.Tensor], Callable]] = {"dense": DenseAttention}


@functools.cache
def compiled_flex_attention():
    """One process-wide compiled flex_attention (compiling per call site multiplies graphs)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@dataclass
class FlexAttention:
    """flex_attention with a BlockMask built from the same mask_mod.

    q_splits > 1 runs the Q queries as q_splits batch entries of Q / q_splits queries against one
    broadcast K, V (flex's KV batch broadcast). Same function, more dK/dV programs in the
    backward (one per KV tile, KV head and batch entry). With the interval mask splitting is
    slower at the reference shape, so the engine runs one entry; bench.variants keeps the splits
    to measure them."""

    block_mask: object
    compiled: bool = True
    q_splits: int = 1

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        fn = compiled_flex_attention() if self.compiled else flex_attention
        gqa = q.shape[1] != k.shape[1]
        if self.q_splits == 1:
            return fn(q, k, v, block_mask=self.block_mask, enable_gqa=gqa)
        _, heads, q_len, dim = q.shape  # [1, H, Q, D] -> [P, H, Q / P, D]
        q = q.transpose(1, 2).reshape(self.q_splits, q_len // self.q_splits, heads, dim).transpose(1, 2)
        out = fn(q, k, v, block_mask=self.block_mask, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(1, q_len, heads, dim).transpose(1, 2)


FLEX_TILE = 128  # BlockMask tile (flex's default block size)


def usable_q_splits(q_len: int, requested: int) -> int:
    """The largest split count <= requested whose entries are whole BlockMask tiles."""
    for p in range(max(1, requested), 1, -1):
        if q_len % (p * FLEX_TILE) == 0:
            return p
    return 1


def _tile_coverage(lo: torch.Tensor, hi: torch.Tensor, kv_tiles: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For intervals [lo, hi) (any shape [...]) and KV tiles of `tile` positions: (touches [..., T],
    covers [..., T]): the interval meets the tile / contains all of it."""
    start = torch.arange(kv_tiles, device=lo.device) * tile
    lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
    touches = (lo < start + tile) & (hi > start) & (hi > lo)
    covers = (lo <= start) & (hi >= start + tile)
    return touches, covers


def tile_lists(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [query tiles, KV tiles] boolean map as BlockMask's per-row counts [1, 1, R] and KV tile
    indices [1, 1, R, T] (the set ones first, in order)."""
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def dflash_block_mask(
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    mask_mod: MaskMod,
    tile: int = FLEX_TILE,
    sliding_window: int | None = None,
):
    """The BlockMask of the DFlash mask, built from its closed form with a few small tensor ops:
    which KV tiles each query tile touches, and which it sees whole.

    Query block j sees two intervals: its context [lo_j, hi_j) (context_intervals) and its own
    block [S + jB, S + (j + 1)B). A (query tile, KV tile) pair is needed when some row of the
    query tile sees some of the KV tile, and full when every row sees all of it. The intervals of
    one block never join into one (the context ends before the anchor, below S; the block starts
    at S or later), so a tile is seen whole only through one of them. The same answer as
    `create_block_mask` evaluating the mask_mod on every element (tests compare them), without
    the compiled reduction whose Triton build grows to minutes with the number of blocks.
    With a sliding window the rows of a block see different context intervals: a tile is
    touched by their union (from the window of offset 0) and seen whole only within their
    intersection (the window of offset B - 1); the own block, causal then, is never seen whole."""
    from torch.nn.attention.flex_attention import BlockMask

    n = anchors.shape[0]
    q_len, kv_len = n * block_size, seq_len + n * block_size
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    lo, hi = context_intervals(doc_ids, anchors, anchor_valid)
    own = seq_len + torch.arange(n, device=anchors.device) * block_size
    ctx_touch, ctx_full = _tile_coverage(lo, hi, kv_tiles, tile)  # [N, T]
    own_touch, own_full = _tile_coverage(own, own + block_size, kv_tiles, tile)
    if sliding_window is not None:
        widest = torch.maximum(lo, hi - (sliding_window - 1))
        narrowest = torch.maximum(lo, hi + block_size - 1 - (sliding_window - 1))
        ctx_touch, _ = _tile_coverage(widest, hi, kv_tiles, tile)
        _, ctx_full = _tile_coverage(narrowest, hi, kv_tiles, tile)
        own_full = torch.zeros_like(own_full)
    touches, sees_all = ctx_touch | own_touch, ctx_full | own_full  # per query block
    # query tile r holds the rows [r * tile, (r + 1) * tile), i.e. blocks first..last
    rows = torch.arange(q_tiles, device=anchors.device) * tile
    first = rows // block_size
    last = torch.clamp((rows + tile).clamp(max=q_len) - 1, min=0) // block_size
    blocks = torch.arange(n, device=anchors.device)
    member = (blocks >= first.unsqueeze(1)) & (blocks <= last.unsqueeze(1))  # [R, N]
    m = member.unsqueeze(-1)
    partial_or_full = (m & touches.unsqueeze(0)).any(1)  # [R, T]
    full = (~m | sees_all.unsqueeze(0)).all(1) & partial_or_full
    # rows past q_len (a padded last query tile) see nothing: such a tile is not full
    full &= (rows + tile <= q_len).unsqueeze(1)
    partial = partial_or_full & ~full

    kv_num, kv_idx = tile_lists(partial)
    full_num, full_idx = tile_lists(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )


def build_block_mask(
    mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device | str, compiled: bool = False, batches: int = 1
):
    """BlockMask of one micro-batch (`batches` entries of q_len queries each); compiled, the
    [Q, KV] grid is never materialized."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        mask_mod,
        B=batches if batches > 1 else None,
        H=None,
        Q_LEN=q_len,
        KV_LEN=kv_len,
        device=device,
        _compile=compiled,
    )


def training_attention(
    kind: str,
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    *,
    compiled: bool = True,
    compiled_mask: bool = False,
    q_splits: int = 1,
    sliding_window: int | None = None,
):
    """Build the attention callable for one micro-batch ("flex", or a kind of DENSE_KINDS)."""
    q_len = anchors.shape[0] * block_size
    kv_len = seq_len + q_len
    window = sliding_window
    if kind in DENSE_KINDS:
        mask = dense_mask(
            dflash_mask_mod(doc_ids, anchors, anchor_valid, seq_len, block_size, sliding_window=window),
            q_len,
            kv_len,
            doc_ids.device,
        )
        return DENSE_KINDS[kind](mask)
    if kind == "flex":
        splits = usable_q_splits(q_len, q_splits)
        per = q_len // splits
        mask_mod = dflash_mask_mod(
            doc_ids, anchors, anchor_valid, seq_len, block_size, per if splits > 1 else 0, sliding_window=window
        )
        if splits == 1:
            block_mask = dflash_block_mask(
                doc_ids, anchors, anchor_valid, seq_len, block_size, mask_mod, sliding_window=window
            )
        else:  # the benchmarks' query splits: the generic construction
            block_mask = build_block_mask(mask_mod, per, kv_len, doc_ids.device, compiled_mask, batches=splits)
        return FlexAttention(block_mask, compiled=compiled, q_splits=splits)
    raise ValueError(f"unknown attention kind {kind!r}; expected one of {['flex', *DENSE_KINDS]}")


def inference_mask(
    context_len: int, block_size: int, sliding_window: int | None, device: torch.device | str
) -> torch.Tensor | None:
    """The mask of one block at inference (context = all of the past, block = the next B
    positions): None (everything) for a full-attention drafter; with a sliding window, the
    training rule's window and the causal own block."""
    if sliding_window is None:
        return None
    o = torch.arange(block_size, device=device).view(-1, 1)
    kv = torch.arange(context_len + block_size, device=device).view(1, -1)
    ctx = (kv < context_len) & (kv >= context_len + o - (sliding_window - 1))
    own = (kv >= context_len) & (kv - context_len <= o)
    return ctx | own
