"""The static-cache decode loop (dflash_core.regenerate.decode) on the CPU against transformers' own
`generate`: greedy output token for token, for prompts of different lengths decoded together,
with slots refilled as sequences finish (some early, at the end-of-turn token, some at the
token limit); right-padded prefills through causal attention on models with full and sliding
layers; seeded sampling that depends on the seed alone."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from dflash_core.regenerate.decode import Request, SlotDecoder
from dflash_core.regenerate.sampling import Sampling, choose_tokens
from tests.helpers import heldout_prompt_ids
from tests.tiny_decoders import tiny_llama, tiny_sliding_qwen3

MAX_NEW = 24


@pytest.fixture(scope="module")
def target(default_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_assets.target))
    model = AutoModelForCausalLM.from_pretrained(
        str(default_assets.target), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return model, tok


@pytest.fixture(scope="module")
def prompts(default_assets, target):
    """Token ids of held-out prompts (each conversation up to its last user turn), as the chat
    template renders them with the generation prompt."""
    _, tok = target
    out = heldout_prompt_ids(default_assets.heldout, tok, 7)
    assert len({len(p) for p in out}) > 3, "the prompts must differ in length"
    return out


@pytest.fixture(scope="module")
def reference(target, prompts):
    """transformers' greedy generate, one prompt at a time."""
    model, _ = target
    out = []
    for ids in prompts:
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
        out.append(full[0, len(ids) :].tolist())
    return out


def _run(model, prompts, sampling, slots=3, length=160, max_new=MAX_NEW, seeds=None, order=None):
    decoder = SlotDecoder(model, slots=slots, length=length)
    order = list(range(len(prompts))) if order is None else order
    requests = [Request(k, prompts[k], max_new, seed=(seeds or {}).get(k, k)) for k in order]
    return {c.key: c for c in decoder.generate(requests, sampling)}


def test_greedy_equals_transformers_generate(target, prompts, reference):
    model, _ = target
    eos = model.generation_config.eos_token_id
    done = _run(model, prompts, Sampling(stop_token_ids=(eos,)))
    assert [done[k].tokens for k in range(len(prompts))] == reference
    reasons = sorted(done[k].finish_reason for k in done)
    # some stop at the end-of-turn token before the limit (their slot is refilled), some reach it
    assert {"stop", "length"} <= set(reasons), reasons
    assert all(len(done[k].tokens) < MAX_NEW for k in done if done[k].finish_reason == "stop")


def test_greedy_at_the_token_limit(target, prompts, reference):
    """A limit below every answer's length: each sequence ends at the limit, equal to the prefix."""
    model, _ = target
    eos = model.generation_config.eos_token_id
    done = _run(model, prompts, Sampling(stop_token_ids=(eos,)), slots=4, max_new=5)
    for k, ref in enumerate(reference):
        assert done[k].tokens == ref[:5]
        assert done[k].finish_reason == ("stop" if len(ref) <= 5 and ref[-1] == eos else "length")


def test_one_slot_equals_many(target, prompts):
    model, _ = target
    eos = model.generation_config.eos_token_id
    one = _run(model, prompts, Sampling(stop_token_ids=(eos,)), slots=1)
    many = _run(model, prompts, Sampling(stop_token_ids=(eos,)), slots=8)
    assert {k: c.tokens for k, c in one.items()} == {k: c.tokens for k, c in many.items()}


def test_seeded_sampling_depends_on_the_seed_only(target, prompts):
    model, _ = target
    eos = model.generation_config.eos_token_id
    sampling = Sampling(temperature=1.3, top_p=0.95, top_k=40, stop_token_ids=(eos,))
    seeds = {k: 1000 + k for k in range(len(prompts))}
    a = _run(model, prompts, sampling, slots=2, seeds=seeds)
    b = _run(model, prompts, sampling, slots=5, seeds=seeds, order=list(reversed(range(len(prompts)))))
    assert {k: c.tokens for k, c in a.items()} == {k: c.tokens for k, c in b.items()}
    other = _run(model, prompts, sampling, slots=2, seeds={k: 7 + k for k in range(len(prompts))})
    assert {k: c.tokens for k, c in other.items()} != {k: c.tokens for k, c in a.items()}


def test_top_k_one_is_greedy(target, prompts, reference):
    model, _ = target
    eos = model.generation_config.eos_token_id
    done = _run(model, prompts, Sampling(temperature=0.7, top_k=1, stop_token_ids=(eos,)))
    assert [done[k].tokens for k in range(len(prompts))] == reference


def test_sampler_follows_the_distribution():
    """Gumbel-max over the counter-based noise draws tokens with their softmax probabilities,
    and top_p keeps only the smallest set that reaches it."""
    n = 20000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(n, 1)
    seeds = torch.arange(n, dtype=torch.long)
    steps = torch.zeros(n, dtype=torch.long)
    one = torch.ones(1)
    no_k = torch.zeros(1, dtype=torch.long)
    for mode in ("sample", "filtered", "top-p"):  # top_p 1 filters nothing: the modes draw the same tokens
        picks = choose_tokens(logits, seeds, steps, mode, one, no_k, one)
        freq = torch.bincount(picks, minlength=4).float() / n
        assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015), freq
    assert torch.equal(picks, choose_tokens(logits, seeds, steps, "sample", one, no_k, one))
    for mode in ("filtered", "top-p"):
        picks = choose_tokens(logits, seeds, steps, mode, one, no_k, torch.tensor([0.7]))
        freq = torch.bincount(picks, minlength=4).float() / n
        assert freq[2:].sum() == 0 and abs(freq[0] - 0.5 / 0.8) < 0.015, freq


def test_top_k_picked_equals_top_k_sorted():
    """The top-<k> mode's filter (each row's k largest, picked) keeps what the sorted filter keeps,
    with top_p after it as transformers applies them; a k past the vocabulary keeps it all."""
    from dflash_core.regenerate.sampling import STATIC_TOP_K, keep_top, keep_top_k

    g = torch.Generator().manual_seed(5)
    scaled = torch.randn(16, 3000, generator=g) * torch.linspace(0.5, 6, 16).unsqueeze(-1)  # flat to peaked rows
    for k in (1, 7, 40, STATIC_TOP_K, 5000):
        for p in (0.3, 0.9, 1.0):
            want = keep_top(scaled, torch.tensor([k]), torch.tensor([p]))
            got = keep_top_k(scaled, k, torch.tensor([p]))
            assert torch.equal(got, want), (k, p)
    assert Sampling(temperature=0.7, top_k=20, top_p=0.8).mode == "top-20"
    assert Sampling(temperature=0.7, top_k=STATIC_TOP_K + 1).mode == "filtered"
    assert Sampling(temperature=0.7, top_p=0.8).mode == "top-p"
    assert Sampling(temperature=0.7).mode == "sample" and Sampling(top_k=20).mode == "greedy"


def test_top_p_cuts_ties_whole():
    """Tied values at top_p's cut are kept or cut together, whichever order the sort left them in:
    the cut counts the probability of the strictly more probable tokens."""
    from dflash_core.regenerate.sampling import keep_top

    # 0.4, then four tokens of 0.15, the probability above each of them 0.4: with top_p 0.39 the
    # tie is cut whole; with 0.5, where a cut by rank would keep one of them (0.4 + 0.15 reaches
    # it), kept whole
    probs = torch.tensor([[0.4, 0.15, 0.15, 0.15, 0.15]])
    no_k = torch.zeros(1, dtype=torch.long)
    assert (keep_top(probs.log(), no_k, torch.tensor([0.39])) > float("-inf")).tolist() == [[True] + [False] * 4]
    assert (keep_top(probs.log(), no_k, torch.tensor([0.5])) > float("-inf")).tolist() == [[True] * 5]


def test_slots_refilled_in_batches(target, prompts, reference):
    """More requests than slots, with slots refilled a few at a time (slots // 16 of them)."""
    from dflash_core.regenerate.decode import Request, SlotDecoder

    model, _ = target
    eos = model.generation_config.eos_token_id
    decoder = SlotDecoder(model, slots=32, length=160)
    assert decoder.admit_batch == 2
    requests = [Request((k, c), prompts[k], MAX_NEW) for c in range(6) for k in range(len(prompts))]
    done = list(decoder.generate(requests, Sampling(stop_token_ids=(eos,))))
    assert sorted(c.key for c in done) == sorted(r.key for r in requests)
    assert all(c.tokens == reference[c.key[0]] for c in done)


def test_idle_slots_are_parked(target, prompts, reference):
    """A slot without a sequence sits at the cache's last position, which no sequence feeds: at
    the start, once its sequence ends (here with slots refilled, some ending at the end-of-turn
    token, some at the limit), and after a generate stopped mid-way, whose next run decodes as
    a fresh decoder does."""
    from dflash_core.regenerate.decode import Request, SlotDecoder

    model, _ = target
    eos = model.generation_config.eos_token_id
    greedy = Sampling(stop_token_ids=(eos,))
    decoder = SlotDecoder(model, slots=3, length=160)
    assert decoder.parked == 159 and decoder.positions.tolist() == [159] * 3
    requests = [Request(k, p, MAX_NEW) for k, p in enumerate(prompts)]
    seen = []
    for _ in decoder.generate(requests, greedy):
        seen.append(sum(p == decoder.parked for p in decoder.positions.tolist()))
    assert decoder.positions.tolist() == [159] * 3
    assert max(seen) >= 1  # slots freed once the prompts ran out, parked while the others decode
    steps = iter(range(10**6))
    stopped = list(decoder.generate(requests, greedy, lambda: next(steps) >= 4))
    assert len(stopped) < len(prompts)
    assert decoder.positions.tolist() == [159] * 3
    done = {c.key: c.tokens for c in decoder.generate(requests, greedy)}
    assert [done[k] for k in range(len(prompts))] == reference


def _sdpa_calls(monkeypatch) -> list[str]:
    """What each SDPA call of the prefills attends under: "causal" or "mask"."""
    calls: list[str] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append("causal" if kwargs.get("is_causal") else "mask" if kwargs.get("attn_mask") is not None else "?")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("build", [tiny_sliding_qwen3, tiny_llama])
def test_padded_prefills_equal_generate(build, monkeypatch):
    """Waves of prompts of different lengths, each wave prefilled as one right-padded chunk:
    narrower than the sliding window (6), as wide, wider, and one token wide. Greedy tokens equal
    generate's; the full layers attend through SDPA's causal attention with no mask, a sliding
    layer too where the chunk fits its window, else under the window's mask."""
    model = build()
    # Llama's default end token: generate would stop there, the decoder without stop tokens does not
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(3)
    dec = SlotDecoder(model, slots=3, length=32)
    sliding = dec.kinds.count("sliding_attention")
    calls = _sdpa_calls(monkeypatch)
    for wave in ([3, 5, 2], [6, 1], [9, 14, 4], [1, 1]):
        prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in wave]
        calls.clear()
        done = {c.key: c.tokens for c in dec.generate([Request(k, p, 10) for k, p in enumerate(prompts)], Sampling())}
        masked = sliding if max(wave) > (dec.window or max(wave)) else 0
        assert sorted(calls) == sorted(["causal"] * (len(dec.kinds) - masked) + ["mask"] * masked), (wave, calls)
        for k, p in enumerate(prompts):
            with torch.no_grad():
                full = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, pad_token_id=0)
            assert done[k] == full[0, len(p) :].tolist(), (wave, k)


def test_causal_prefill_attention_equals_the_masked_one():
    """The causal marker's SDPA over grouped heads against the path under a boolean causal mask
    (keys repeated per head), the query head of each key-value head as transformers groups them."""
    from dflash_core.regenerate.attention import prefill_causal, slot_attention

    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, 7, 16, generator=g) for h in (6, 2, 2))
    mask = torch.ones(7, 7, dtype=torch.bool).tril().view(1, 1, 7, 7)
    causal, _ = slot_attention(None, query, key, value, prefill_causal("cpu"))
    masked, _ = slot_attention(None, query, key, value, mask)
    assert causal.shape == (2, 7, 6, 16)
    torch.testing.assert_close(causal, masked)


def test_prompts_riding_in_the_decode_steps_equal_generate(target, prompts, reference):
    """Chunked prefill (regenerate/ride.py): with most slots decoding, refilled prompts ride in
    the decode steps, 16 tokens a step (a prompt over several steps); the first wave is prefilled
    whole. Greedy tokens equal generate's, and seeded sampling gives the tokens the decoder gives
    with every prompt prefilled whole."""
    model, _ = target
    eos = model.generation_config.eos_token_id
    requests = [Request(k, p, MAX_NEW, seed=k) for k, p in enumerate(prompts)]
    riding = SlotDecoder(model, slots=3, length=160, ride_rows=16)
    done = {c.key: c.tokens for c in riding.generate(requests, Sampling(stop_token_ids=(eos,)))}
    assert [done[k] for k in range(len(prompts))] == reference
    assert 0 < riding.riding_steps < riding.decode_steps, "some steps carry prompt rows, the others none"
    assert riding.prefill_seconds > 0  # the first wave's prompts, prefilled whole
    sampling = Sampling(temperature=1.1, top_p=0.9, stop_token_ids=(eos,))
    whole = {c.key: c.tokens for c in SlotDecoder(model, slots=3, length=160).generate(requests, sampling)}
    rode = {c.key: c.tokens for c in riding.generate(requests, sampling)}
    assert rode == whole


@pytest.mark.parametrize("build", [tiny_sliding_qwen3, tiny_llama])
def test_riding_prompts_over_several_steps_equal_generate(build):
    """Prompts of 1 to 38 tokens in a cache of 40 riding up to 16 tokens a step (the long ones
    over several steps, past the sliding window of 6; a step of 4 tokens at the narrow width of
    4 rows; a one-token prompt rides none, its token is its slot's query at once; the longest
    leave room for 2 and 4 tokens), sequences ending apart so that slots free while others
    decode: generate's greedy tokens, from a decoder whose previous generate was stopped while
    prompts rode."""
    model = build()
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(3)
    widths = [1, 14, 5, 9, 1, 12, 38, 3, 7, 36, 2, 11, 6]
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in widths]
    limits = [min(2 + (5 * k) % 9, 40 - len(p)) for k, p in enumerate(prompts)]
    requests = [Request(k, p, n) for k, (p, n) in enumerate(zip(prompts, limits))]
    dec = SlotDecoder(model, slots=4, length=40, ride_rows=16)
    stopped = list(dec.generate(requests, Sampling(), lambda: dec.riding_steps >= 3))
    assert dec.riding_steps == 3 and len(stopped) < len(requests)
    done = {c.key: c.tokens for c in dec.generate(requests, Sampling())}
    assert dec.riding_steps >= 3 + 6 and set(dec.width_steps) == {16, 4}, dec.width_steps
    for k, (p, n) in enumerate(zip(prompts, limits)):
        with torch.no_grad():
            full = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n, pad_token_id=0)
        assert done[k] == full[0, len(p) :].tolist(), k


def test_a_riding_step_runs_its_width_of_rows_the_unfilled_ones_parked(monkeypatch):
    """Each riding step's rows as its first layer writes them: the slots' rows, then exactly the
    width the queue chose (no row past it, whatever a wider step left there), the unfilled ones
    at slot 0's parked position; steps at both widths, narrow ones partly filled and right after
    wide ones; generate's tokens."""
    from dflash_core.regenerate import ride
    from dflash_core.regenerate.cache import SlotCache

    model = tiny_llama()
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(5)
    lens = [3, 20, 2, 4, 17, 3, 9, 2, 30, 5, 12, 3]
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in lens]
    limits = [min(3 + (5 * k) % 9, 40 - len(p)) for k, p in enumerate(prompts)]
    given, seen, inside = [], [], [False]
    next_rows, step, update = ride.RideQueue.next_rows, SlotDecoder._step, SlotCache.update

    # spies: each calls through to the code it watches
    def rows_spy(self):
        given.append(next_rows(self))
        return given[-1]

    def step_spy(self, mode, width=0):
        inside[0] = True
        try:
            return step(self, mode, width)
        finally:
            inside[0] = False

    def update_spy(self, k, v, layer_idx, *args, **kwargs):
        if inside[0] and layer_idx == 0:
            seen.append((self.positions.tolist(), None if self.slot_of is None else self.slot_of.tolist()))
        return update(self, k, v, layer_idx, *args, **kwargs)

    monkeypatch.setattr(ride.RideQueue, "next_rows", rows_spy)
    monkeypatch.setattr(SlotDecoder, "_step", step_spy)
    monkeypatch.setattr(SlotCache, "update", update_spy)
    dec = SlotDecoder(model, slots=4, length=40, ride_rows=16)
    requests = [Request(k, p, n) for k, (p, n) in enumerate(zip(prompts, limits))]
    done = {c.key: c.tokens for c in dec.generate(requests, Sampling())}
    assert len(seen) == len(given)
    for rows, (positions, slot_of) in zip(given, seen):
        assert len(positions) == dec.slots + rows.width
        if rows.width:
            assert positions[dec.slots :] == rows.positions and slot_of[dec.slots :] == rows.slots
            pad = rows.width - rows.filled
            assert rows.positions[rows.filled :] == [dec.parked] * pad and rows.slots[rows.filled :] == [0] * pad
    widths = {r.width for r in given if r.width}
    assert widths == {16, 4} and any(0 < r.filled < 4 for r in given), [(r.filled, r.width) for r in given]
    assert any(r.width == 4 and i and given[i - 1].width == 16 for i, r in enumerate(given))  # narrow after wide
    for k, (p, n) in enumerate(zip(prompts, limits)):
        with torch.no_grad():
            full = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n, pad_token_id=0)
        assert done[k] == full[0, len(p) :].tolist(), k


def _refuse(request):
    raise ValueError(f"a prompt of {len(request.prompt)} tokens does not fit")


def test_ride_queue_feeds_prompts_in_order_and_seats_their_last_token():
    from dflash_core.regenerate.ride import RideQueue

    queue = RideQueue((1, 4), parked=99)
    a, b, c = Request("a", [10, 11, 12, 13, 14, 15], 5), Request("b", [20], 5), Request("c", [30, 31, 32], 5)
    for slot, request in ((2, a), (0, b), (5, c)):
        queue.add(slot, request)
    assert queue.backlog() == 5 + 0 + 2
    first = queue.next_rows()  # a's first four tokens; a goes on next step
    assert (first.tokens, first.slots, first.positions) == ([10, 11, 12, 13], [2] * 4, [0, 1, 2, 3])
    assert first.filled == 4 and first.width == 4 and first.seated == []
    second = queue.next_rows()  # a's fifth (its sixth is slot 2's query), b seated with no row, c's two
    assert second.tokens == [14, 30, 31, 0] and second.slots == [2, 5, 5, 0]
    assert second.positions == [4, 0, 1, 99] and second.filled == 3 and second.width == 4
    assert [(s, r.key) for s, r in second.seated] == [(2, "a"), (0, "b"), (5, "c")]
    assert len(queue) == 0 and queue.backlog() == 0
    idle = queue.next_rows()
    assert idle.filled == idle.width == 0 and idle.positions == [] and idle.seated == []
    # one token to ride: the narrow width, no parked row
    queue.add(1, Request("d", [40, 41], 5))
    narrow = queue.next_rows()
    assert (narrow.tokens, narrow.slots, narrow.positions, narrow.width) == ([40], [1], [0], 1)
    # boarding: prompts of 8 tokens (7 rows each) while the queue holds at most 4 steps' 16 rows
    free, pending = deque([3, 6, 7, 1]), deque(Request(k, [1] * 8, 5) for k in range(3))
    queue.board(free, pending, lambda r: r)
    assert [r.key for r in pending] == [2] and list(free) == [7, 1] and queue.backlog() == 14
    with pytest.raises(ValueError, match="does not fit"):
        queue.board(deque([0]), deque([Request("long", [1] * 3, 5)]), _refuse)
    with pytest.raises(ValueError, match="at least one row"):
        RideQueue((0, 4), parked=99)
    with pytest.raises(ValueError, match="at least one row"):
        RideQueue((), parked=99)


def test_riding_rows_by_default_where_the_kernel_attends(target):
    """Twice the slots, at most 512, where the step attends through the kernel (CUDA); none on
    the masked path, so a CPU decoder prefills every prompt unless told otherwise. The widths of
    a riding step: the rows, then each a quarter of the one before, down to a few rows."""
    from dflash_core.regenerate.ride import riding_rows, riding_widths

    assert [riding_rows(n, True) for n in (3, 128, 256, 512)] == [6, 256, 512, 512]
    assert riding_rows(256, False) == 0 and riding_rows(1, True) == 0
    assert riding_widths(512) == (512, 128, 32, 8) and riding_widths(24) == (24, 6)
    assert riding_widths(15) == (15,) and riding_widths(16) == (16, 4) and riding_widths(0) == ()
    model, _ = target
    assert SlotDecoder(model, slots=4, length=64).ride_widths == ()
    dec = SlotDecoder(model, slots=4, length=64, attention_kernel=True, use_graph=False)
    assert dec.ride_rows == 8 and dec.ride_widths == (8,)
