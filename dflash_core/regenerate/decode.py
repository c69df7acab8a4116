"""Batched decoding of a transformers causal LM with a static KV cache and continuous batching.

`SlotDecoder` holds a fixed number of slots (sequences decoded together) and a KV cache of a
fixed length per slot, allocated once. Every decode step runs all slots with the same shapes
(one new token each; attention over each slot's valid cache positions, told by a device tensor,
through a Triton kernel on CUDA, or over the whole static cache under a per-slot mask; see
attention.py), so on CUDA the step is recorded once as a CUDA graph and replayed; on the CPU the same step runs eagerly
(the tests compare that loop with transformers' own `generate`). A finished sequence frees its
slot, and the next prompts go into the free slots while the others keep decoding (continuous
batching); prompts are prefilled several at a time, right-padded, with only the last prompt
position's logits computed (prefill.py), or, while most slots decode, ride in the decode steps as
rows of their own (ride.py: chunked prefill). A slot without a sequence (never filled, or finished)
is parked at the cache's last position, which no sequence feeds (a prompt of P tokens leaves room
for at most length - P tokens, the last of them never fed: positions up to length - 2); its
range is that one position (decode_ranges), so with the kernel an idle slot's step reads one key
per layer, not the range its last sequence had reached (a mask reads the whole cache anyway).

The model is driven through its own decoder: the cache is an object with transformers' `update`
method that writes each slot's keys and values at that slot's position, the positions go in as
`position_ids` (RoPE), and the masks as the per-layer-type dict the model's forward takes in
place of `attention_mask` (what `generate` passes it). So any decoder whose attention layers
call `past_key_values.update` and whose layers are full or sliding attention runs unchanged.

Tokens are chosen as sampling.py says (greedy, or seeded Gumbel-max sampling that depends on a
sequence's seed alone); each sampling mode is its own recorded step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..target_norms import NormKernels
from ..target_qkv import fused_qkv
from ..target_rope import RopeKernels
from .attention import SLOT_ATTENTION, decode_ranges, kernel_available, register_attention
from .cache import SlotCache
from .logits import OutputLogits
from .prefill import chunk_bounds, padded_prompts, prefill_attention
from .ride import RideQueue, RideRows, riding_rows, riding_widths
from .sampling import M32, Sampling, choose_tokens, floor_kernel_matches, sample_kernel_matches

log = logging.getLogger("dflash.generate")

# bytes of scratch per prefilled token (activations of one layer, the gathered rows): prefill
# chunks are sized so that a chunk's transient memory stays small next to the cache
_PREFILL_TOKENS_CUDA = 16384
_PREFILL_TOKENS_CPU = 2048


@dataclass
class Request:
    key: object  # the caller's name for it, handed back with the result
    prompt: list[int]
    max_new_tokens: int
    seed: int = 0


@dataclass
class Completion:
    key: object
    tokens: list[int]
    finish_reason: str  # stop | length
    prompt_tokens: int


@dataclass
class _Slot:
    request: Request
    limit: int  # tokens it may generate (max_new_tokens, or what the cache has room for)
    tokens: list[int] = field(default_factory=list)


def layer_kinds(config) -> list[str]:
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
        kinds = ["sliding_attention" if sliding else "full_attention"] * int(config.num_hidden_layers)
    bad = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if bad:
        raise ValueError(f"regeneration decodes full and sliding attention layers only, not {bad}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("regeneration does not decode attention with soft-capped scores (attn_logit_softcapping)")
    return kinds


class SlotDecoder:
    """Decodes requests with `slots` sequences at a time in a cache of `length` positions per slot
    (prompt plus generated tokens). use_graph: record the decode step as a CUDA graph (CUDA only).
    attention_kernel: the decode step attends through the Triton kernel over the slots' valid
    positions (None: where the device and dtype allow it, attention.kernel_available; True on a
    CPU runs it through Triton's interpreter, for tests), else over the whole cache under masks.
    fused_kernels: the layers' RMSNorms (target_norms.py), rotary embeddings (target_rope.py)
    and the decode step's cache writes (kernels/slot_write.py) run as Triton kernels (None: on
    CUDA), each where it matches what it replaces, and so does a sampled step's choice of tokens
    (kernels/gumbel_max.py: the same tokens as its torch ops) and top-p's cut (kernels/top_p.py,
    probed on its own: the sorted cut's tokens but where a sum rounds across top_p); and each
    attention layer's query, key and value projections run as one GEMM over a copy of their
    weights stacked (target_qkv.py; copied in again at every `generate`; stacked_qkv: whether,
    None: with the fused kernels). ride_rows: prompt tokens a decode step carries beside its slots
    at most (chunked prefill, ride.py; a step narrower where fewer ride) while at least half the
    slots decode (None: riding_rows' choice; 0: every prompt is prefilled)."""

    def __init__(
        self,
        model: Any,
        slots: int,
        length: int,
        use_graph: bool | None = None,
        attention_kernel: bool | None = None,
        fused_kernels: bool | None = None,
        stacked_qkv: bool | None = None,
        ride_rows: int | None = None,
    ):
        self.model: Any = model  # a transformers causal LM
        self.config: Any = self.model.config
        self.decoder: Any = self.model.get_decoder()
        self.head: Any = self.model.get_output_embeddings()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.slots, self.length = slots, length
        self.kinds = layer_kinds(self.config)
        self.window = getattr(self.config, "sliding_window", None)
        register_attention()
        cfg = self.config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.cache = SlotCache(int(cfg.num_hidden_layers), slots, length, heads, head_dim, self.device, self.dtype)
        dev = self.device
        self.vocab = int(self.head.weight.shape[0])
        self.logits = OutputLogits(model)  # the head, and what the family's forward does after it
        # the decode step's inputs and outputs: fixed tensors a recorded graph reads and writes
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)
        self.parked = length - 1  # the position of a slot without a sequence (see the module's doc)
        self.positions = torch.full((slots,), self.parked, dtype=torch.long, device=dev)
        self.steps = torch.zeros(slots, dtype=torch.long, device=dev)
        self.seeds = torch.zeros(slots, dtype=torch.long, device=dev)
        self.next_tokens = torch.zeros(slots, dtype=torch.long, device=dev)
        self.temperature = torch.ones(1, device=dev)
        self.top_k = torch.zeros(1, dtype=torch.long, device=dev)
        self.top_p = torch.ones(1, device=dev)
        self.key_index = torch.arange(length, device=dev)
        self.use_graph = (dev.type == "cuda") if use_graph is None else (use_graph and dev.type == "cuda")
        self.attention_kernel = kernel_available(dev, self.dtype) if attention_kernel is None else attention_kernel
        fuse = (dev.type == "cuda") if fused_kernels is None else fused_kernels
        self.norms = NormKernels.of(model) if fuse else None
        if self.norms is not None and not self.norms.usable():
            self.norms = None
        self.rope = RopeKernels(model) if fuse else None
        if self.rope is not None and not self.rope.usable(self.dtype):
            self.rope = None
        self.cache.write_kernel = fuse and self.cache.kernel_takes(self.dtype)
        stack = fuse if stacked_qkv is None else stacked_qkv
        self.qkv = fused_qkv(model) if stack else None
        self.sample_kernel = fuse and sample_kernel_matches(str(dev))
        self.floor_kernel = self.sample_kernel and floor_kernel_matches(str(dev))
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}  # per sampling mode and riding width
        # one memory pool for all of them: they never run at once, and each copies what it gives
        # into the fixed tensors above, so a narrower step reuses what a wider one was given. The
        # allocator hands a freed block only to the stream that freed it: one capture stream too
        self._pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        self._capture_stream = torch.cuda.Stream(dev) if self.use_graph else None
        self.ride_rows = riding_rows(slots, self.attention_kernel) if ride_rows is None else max(0, int(ride_rows))
        self.ride_widths = riding_widths(self.ride_rows)
        # the riding rows' tokens, slots and positions; rows no prompt fills are parked at slot 0
        self.ride = torch.zeros(3, self.ride_rows, dtype=torch.long, device=dev)
        self.ride[2].fill_(self.parked)
        self.prefill_tokens = _PREFILL_TOKENS_CUDA if dev.type == "cuda" else _PREFILL_TOKENS_CPU
        self.admit_batch = max(1, slots // 16)
        self.tokens_generated = 0
        self.decode_steps = 0  # steps run
        self.width_steps: Counter[int] = Counter()  # those with riding rows, by width
        # wall time of the prefills: each ends reading its tokens on the host, so its device work is in it
        self.prefill_seconds = 0.0

    # ------------------------------------------------------------------ the model
    def _mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor):
        """Per layer kind: query at query_pos [N, Q] sees keys at key_pos [K] up to itself (and
        within the sliding window). Boolean, as slot_attention takes."""
        causal = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)  # [N, Q, K]
        masks = {}
        for kind in dict.fromkeys(self.kinds):
            m = causal
            if kind == "sliding_attention" and self.window:
                m = m & (key_pos.view(1, 1, -1) > query_pos.unsqueeze(-1) - int(self.window))
            masks[kind] = m.unsqueeze(1)  # [N, 1, Q, K]
        return masks

    def _hidden(self, input_ids, position_ids, masks) -> torch.Tensor:
        # the model's attention layers read the implementation from the config at every call:
        # slot_attention for this forward only (the engine's other users of the target keep theirs)
        saved = self.config._attn_implementation
        self.config._attn_implementation = SLOT_ATTENTION
        # a mask per layer kind where the model has several (Qwen3, Gemma read the dict); the one
        # mask where it has one, since some decoders (Llama) take only a tensor, used as given
        attention_mask = masks if len(masks) > 1 else next(iter(masks.values()))
        norms = self.norms.active() if self.norms is not None else contextlib.nullcontext()
        rope = self.rope.active() if self.rope is not None else contextlib.nullcontext()
        qkv = self.qkv.active() if self.qkv is not None else contextlib.nullcontext()
        try:
            with norms, rope, qkv:
                out = self.decoder(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    attention_mask=attention_mask,
                    past_key_values=self.cache,
                    use_cache=True,
                )
        finally:
            self.config._attn_implementation = saved
        return out.last_hidden_state

    def _decode_step(self, mode: str, ride: int = 0) -> None:
        """One token for every slot from self.tokens at self.positions into self.next_tokens; then
        the inputs move on by one (what the next step reads). ride: the first `ride` riding rows
        (self.ride) go through the layers too, after the slots' rows. Fixed shapes: a graph
        records it."""
        cache = self.cache
        tokens, positions, slot_of = self.tokens, self.positions, None
        if ride:
            rows = self.ride[:, :ride]
            tokens = torch.cat((self.tokens, rows[0]))
            positions = torch.cat((self.positions, rows[2]))
            slot_of = torch.cat((cache.slot_index, rows[1]))
        cache.rows, cache.positions, cache.slot_of = None, positions, slot_of
        cache.gather = bool(ride) and not self.attention_kernel
        if self.attention_kernel:  # each slot's valid range per layer kind, in place of its mask
            masks = {
                kind: decode_ranges(
                    positions, self.window if kind == "sliding_attention" else None, self.parked, slot_of
                )
                for kind in dict.fromkeys(self.kinds)
            }
        else:
            masks = {
                kind: torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill(~m, float("-inf"))
                for kind, m in self._mask(positions.unsqueeze(-1), self.key_index).items()
            }
        # the rotary positions: a parked row's at 0, since some embeddings (LongRoPE) pick their
        # factors from the forward's largest position, which an idle slot must not decide
        rotary = positions.masked_fill(positions == self.parked, 0)
        try:
            hidden = self._hidden(tokens.unsqueeze(-1), rotary.unsqueeze(-1), masks)
        finally:  # nothing of a recorded step's memory stays reachable once it is recorded
            cache.positions, cache.slot_of, cache.gather = None, None, False
        logits = self.logits(hidden[: self.slots, -1])
        chosen = choose_tokens(
            logits,
            self.seeds,
            self.steps,
            mode,
            self.temperature,
            self.top_k,
            self.top_p,
            self.sample_kernel,
            self.floor_kernel,
        )
        self.next_tokens.copy_(chosen)
        self.tokens.copy_(chosen)
        # a parked slot stays parked; the others move on, held at the last position a sequence
        # feeds (one that got there has its last token and is parked by the loop next)
        moved = (self.positions + 1).clamp_(max=max(0, self.length - 2))
        self.positions.copy_(torch.where(self.positions == self.parked, self.positions, moved))
        self.steps.add_(1)

    @contextlib.contextmanager
    def _inputs_kept(self) -> Iterator[None]:
        """Steps run inside (warm-ups, a capture) leave the step's inputs as they found them."""
        saved = [t.clone() for t in (self.tokens, self.positions, self.steps)]
        try:
            yield
        finally:
            for t, s in zip((self.tokens, self.positions, self.steps), saved, strict=True):
                t.copy_(s)

    def _record(self, mode: str, ride: int) -> torch.cuda.CUDAGraph:
        dev = self.device
        graph = torch.cuda.CUDAGraph()
        stream = self._capture_stream
        assert stream is not None
        with self._inputs_kept():
            stream.wait_stream(torch.cuda.current_stream(dev))
            # lazy initialisations (cuBLAS handles, the stream's workspaces) outside the graph
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._decode_step(mode, ride)
            torch.cuda.current_stream(dev).wait_stream(stream)
            # thread_local: a daemon's other threads (a metrics scrape reading the allocator) may
            # make CUDA calls meanwhile; they are not part of this capture
            capture = torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local")
            with torch.cuda.device(dev), capture:
                self._decode_step(mode, ride)
            torch.cuda.synchronize(dev)
        return graph

    def warm(self, sampling: Sampling) -> None:
        """Record (CUDA) or run once (CPU) the decode step for this sampling mode, at each riding
        width (widest first: the narrower ones reuse its memory) and without riding rows."""
        with torch.no_grad():
            self._set_sampling(sampling)
            for ride in (*self.ride_widths, 0):
                key = (sampling.mode, ride)
                if self.use_graph:
                    if key not in self._graphs:
                        self._graphs[key] = self._record(*key)
                else:
                    with self._inputs_kept():
                        self._decode_step(*key)

    def _set_sampling(self, sampling: Sampling) -> None:
        self.temperature.fill_(sampling.temperature if sampling.temperature > 0 else 1.0)
        self.top_k.fill_(max(0, sampling.top_k))
        self.top_p.fill_(sampling.top_p)

    def _replay(self, mode: str, ride: int = 0) -> None:
        """One decode step, queued."""
        graph = self._graphs.get((mode, ride)) if self.use_graph else None
        if graph is not None:
            graph.replay()
        else:
            self._decode_step(mode, ride)

    def _step(self, mode: str, ride: int = 0) -> list[int]:
        """One decode step; every slot's token."""
        self._replay(mode, ride)
        return self.next_tokens.tolist()

    def _park(self, slots: list[int]) -> None:
        """The slots hold no sequence from the next step on."""
        if slots:
            self.positions[torch.tensor(slots, dtype=torch.long, device=self.device)] = self.parked

    def _prefill(self, admitted: list[tuple[int, Request]], mode: str) -> torch.Tensor:
        """Prompts into their slots' caches; their first generated tokens (on the device)."""
        dev = self.device
        # every tensor from the host first: a copy from the host waits for the work queued before
        # it, so one made after the forward would hold back the launches of the head and sampling
        ids, pos, lens = padded_prompts([r.prompt for _, r in admitted], dev)
        self.cache.rows = torch.tensor([s for s, _ in admitted], dtype=torch.long, device=dev)
        seeds = torch.tensor([r.seed for _, r in admitted], dtype=torch.long, device=dev)
        steps = torch.zeros(len(admitted), dtype=torch.long, device=dev)
        self.cache.positions = None
        try:
            hidden = self._hidden(ids, pos, prefill_attention(self.kinds, self.window, ids.shape[1], dev))
        finally:
            self.cache.rows = None
        last = hidden[torch.arange(len(admitted), device=dev), lens - 1]
        logits = self.logits(last)
        return choose_tokens(
            logits, seeds, steps, mode, self.temperature, self.top_k, self.top_p, self.sample_kernel, self.floor_kernel
        )

    # ------------------------------------------------------------------ the loop
    def generate(
        self,
        requests: Iterable[Request],
        sampling: Sampling,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[Completion]:
        """Completions in the order they finish. Requests are taken in the given order as slots
        free up (sort them by prompt length for even prefills). should_stop() is read between
        steps: the sequences in flight are dropped."""
        with torch.no_grad():
            if self.qkv is not None:  # the target's weights as they are now (a swap writes them in place)
                self.qkv.refresh()
            self.warm(sampling)
            try:
                yield from self._generate(iter(requests), sampling, should_stop)
            finally:
                self._park(list(range(self.slots)))  # what a stop left in flight is dropped

    def _generate(self, pending_iter: Iterator[Request], sampling: Sampling, should_stop) -> Iterator[Completion]:
        mode = sampling.mode
        stops = set() if sampling.ignore_stop else set(sampling.stop_token_ids)
        active: dict[int, _Slot] = {}
        free = deque(range(self.slots))
        pending: deque[Request] = deque()
        riding = RideQueue(self.ride_widths, self.parked) if self.ride_widths else None
        exhausted = False
        while True:
            if should_stop():
                return
            while not exhausted and len(pending) < len(free):
                nxt = next(pending_iter, None)
                if nxt is None:
                    exhausted = True
                else:
                    pending.append(nxt)
            # while most slots decode, a freed slot's prompt rides in their steps (ride.py)
            if riding is not None and free and pending and active and 2 * len(active) >= self.slots:
                riding.board(free, pending, self._fits)
            # prompts go in once a few slots are free (each prefill is an eager forward: one per
            # freed slot would cost more host time than the idle slots cost steps), or when none runs
            if free and pending and (len(free) >= self.admit_batch or not active):
                yield from self._admit(active, free, pending, mode, stops)
            if not active and not riding:
                if exhausted and not pending:
                    return
                continue
            ride = 0
            if riding is not None:
                rows = riding.next_rows()
                ride = self._load_ride(rows)
                self._seat(rows.seated, active)
            chosen = self._step(mode, ride)
            self.decode_steps += 1
            if ride:
                self.width_steps[ride] += 1
            self.tokens_generated += len(active)
            finished = []
            for slot in list(active):
                state = active[slot]
                token = chosen[slot]
                state.tokens.append(token)
                if token in stops or len(state.tokens) >= state.limit:
                    del active[slot]
                    finished.append(slot)
                    yield self._done(state, token in stops)
            self._park(finished)
            free.extend(finished)

    @property
    def riding_steps(self) -> int:
        """Steps run with riding rows."""
        return sum(self.width_steps.values())

    def _fits(self, request: Request) -> Request:
        if not request.prompt or len(request.prompt) >= self.length:
            raise ValueError(f"a prompt of {len(request.prompt)} tokens does not fit a cache of {self.length}")
        return request

    def _limit(self, request: Request) -> int:
        return max(1, min(request.max_new_tokens, self.length - len(request.prompt)))

    def _load_ride(self, rows: RideRows) -> int:
        """The next step's riding rows into self.ride; their width (0: none)."""
        if rows.width:
            self.ride[:, : rows.width] = torch.tensor([rows.tokens, rows.slots, rows.positions], dtype=torch.long)
        return rows.width

    def _seat(self, seated: list[tuple[int, Request]], active: dict[int, _Slot]) -> None:
        """Each prompt's last token as its slot's query in the step about to run, at step 0 as
        after a prefill (that step carries the last of the tokens before it): the slot is active
        from that step on."""
        if not seated:
            return
        lasts = torch.tensor([r.prompt[-1] for _, r in seated], dtype=torch.long)
        self._place(seated, lasts, [len(r.prompt) - 1 for _, r in seated], 0)
        for slot, request in seated:
            active[slot] = _Slot(request, self._limit(request))

    def _place(self, placed: list[tuple[int, Request]], tokens: torch.Tensor, positions: list[int], step: int) -> None:
        """What each placed slot's next step reads: its token (host or device), its position, its
        sampling step and its request's seed."""
        dev = self.device
        slots = torch.tensor([s for s, _ in placed], dtype=torch.long, device=dev)
        host = torch.tensor([positions, [r.seed & M32 for _, r in placed]], dtype=torch.long).to(dev)
        self.tokens[slots] = tokens.to(device=dev, dtype=torch.long)
        self.positions[slots] = host[0]
        self.seeds[slots] = host[1]
        self.steps[slots] = step

    def _admit(self, active, free, pending, mode, stops) -> Iterator[Completion]:
        """Prefill as many pending prompts as there are free slots, in chunks of similar width."""
        batch: list[tuple[int, Request]] = []
        while free and pending:
            batch.append((free.popleft(), self._fits(pending.popleft())))
        for start, end in chunk_bounds([len(r.prompt) for _, r in batch], self.prefill_tokens):
            chunk = batch[start:end]
            began = time.perf_counter()
            firsts = self._prefill(chunk, mode)
            tokens = firsts.tolist()
            self.prefill_seconds += time.perf_counter() - began
            self._place(chunk, firsts, [len(r.prompt) for _, r in chunk], 1)
            self.tokens_generated += len(chunk)
            ended = []
            for (slot, request), token in zip(chunk, tokens, strict=True):
                limit = self._limit(request)
                state = _Slot(request, limit, [token])
                if token in stops or limit <= 1:
                    ended.append(slot)
                    yield self._done(state, token in stops)
                else:
                    active[slot] = state
            self._park(ended)
            free.extend(ended)

    @staticmethod
    def _done(state: _Slot, stopped: bool) -> Completion:
        return Completion(state.request.key, state.tokens, "stop" if stopped else "length", len(state.request.prompt))
