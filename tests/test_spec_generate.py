"""The shipped modeling file decodes as the z-lab README shows: a checkpoint directory loads with
`AutoModel.from_pretrained(dir, trust_remote_code=True)`, and `spec_generate(target=...,
input_ids=..., max_new_tokens=..., stop_token_ids=..., temperature=...)` gives exactly the
target's greedy output (and its sampling distribution when temperature > 0)."""

from __future__ import annotations

import pytest
import torch

from dflash_core.modeling_dflash import _Sampling
from tests.helpers import train_spec


@pytest.fixture(scope="module")
def trained(default_assets, tmp_path_factory):
    """A drafter trained by the real engine on the default target: its final checkpoint."""
    from dflash_core.engine import Engine, EngineConfig, TrainJob

    cfg = EngineConfig(drafter_devices=["cpu"], seq_len=256, num_anchors=32, block_size=8)
    engine = Engine(cfg, default_assets.root.parent.parent).build()
    out = tmp_path_factory.mktemp("spec_generate")
    try:
        job = TrainJob(**train_spec(default_assets, out, 60))
        res = engine.run_job(job)
        assert res.status == "SUCCEEDED"
        return res.final_checkpoint
    finally:
        engine.close()


@pytest.fixture(scope="module")
def zlab_usage(trained, default_assets, tmp_path_factory):
    """The z-lab README's loading code, against our checkpoint directory."""
    import os

    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf-modules")))
    draft = AutoModel.from_pretrained(str(trained), trust_remote_code=True, dtype="auto").eval()
    target = AutoModelForCausalLM.from_pretrained(str(default_assets.target), dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(default_assets.target))
    return draft, target, tokenizer


def prompts(default_assets, tokenizer, n=3):
    from dflash_core.data.conversations import read_conversations
    from dflash_core.evaluate import prompt_ids

    return [
        torch.tensor([prompt_ids(tokenizer, c.messages)]) for c in list(read_conversations(default_assets.heldout))[:n]
    ]


def greedy(target, ids, n, stop):
    """The target alone: HF generate, greedy."""
    out = target.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=stop, pad_token_id=0)
    return out


def test_greedy_spec_generate_is_the_target_greedy_output(zlab_usage, default_assets):
    draft, target, tokenizer = zlab_usage
    calls = []
    hook = target.register_forward_hook(lambda *_: calls.append(1))
    try:
        generated = verify_calls = 0
        for ids in prompts(default_assets, tokenizer):
            calls.clear()
            got = draft.spec_generate(
                target=target,
                input_ids=ids,
                max_new_tokens=40,
                stop_token_ids=[tokenizer.eos_token_id],
                temperature=0.0,
            )
            verify_calls += len(calls) - 1  # the prefill is not a verification
            generated += got.shape[1] - ids.shape[1]
            want = greedy(target, ids, 40, tokenizer.eos_token_id)
            assert torch.equal(got, want)
    finally:
        hook.remove()
    assert generated > verify_calls  # blocks were accepted: more tokens than target verifications


def test_the_zlab_readme_lines_run_as_written(trained, default_assets, zlab_usage):
    """z-lab's README "Transformers" example with our checkpoint and the tiny target (device_map
    left out: it needs accelerate): the chat template's output goes in as it comes."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    draft = AutoModel.from_pretrained(str(trained), trust_remote_code=True, dtype="auto").eval()
    target = AutoModelForCausalLM.from_pretrained(str(default_assets.target), dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(default_assets.target))
    messages = [{"role": "user", "content": "count to five"}]
    input_ids = tokenizer.apply_chat_template(messages, return_tensors="pt", add_generation_prompt=True).to(
        draft.device
    )
    output = draft.spec_generate(
        input_ids=input_ids, max_new_tokens=32, temperature=0.0, target=target, stop_token_ids=[tokenizer.eos_token_id]
    )
    text = tokenizer.decode(output[0], skip_special_tokens=False)
    ids = input_ids["input_ids"]
    assert torch.equal(output[:, : ids.shape[1]], ids) and len(text) > 0
    assert torch.equal(output, greedy(target, ids, 32, tokenizer.eos_token_id))


def test_stop_tokens_end_the_output(zlab_usage, default_assets):
    draft, target, tokenizer = zlab_usage
    ids = prompts(default_assets, tokenizer, 1)[0]
    full = greedy(target, ids, 30, None)[0, ids.shape[1] :].tolist()
    stop = full[7]  # a token the target produces; the output ends at its first occurrence
    end = full.index(stop) + 1
    got = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=30, stop_token_ids=[stop])
    assert got[0, ids.shape[1] :].tolist() == full[:end]
    short = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=5, stop_token_ids=[])
    assert short[0, ids.shape[1] :].tolist() == full[:5]


def test_sampled_spec_generate_runs_and_repeats_with_a_seed(zlab_usage, default_assets):
    draft, target, tokenizer = zlab_usage
    ids = prompts(default_assets, tokenizer, 1)[0]
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(
            draft.spec_generate(
                target=target,
                input_ids=ids,
                max_new_tokens=24,
                stop_token_ids=[tokenizer.eos_token_id],
                temperature=0.8,
                top_p=0.95,
            )
        )
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0][:, : ids.shape[1]], ids) and runs[0].shape[1] > ids.shape[1]
    assert int(runs[0].max()) < target.config.vocab_size
    with pytest.raises(ValueError, match="temperature"):
        draft.spec_generate(target=target, input_ids=ids, max_new_tokens=4, stop_token_ids=[], temperature=-1.0)


def test_rejection_sampling_emits_the_target_distribution():
    """Whatever the drafter proposes, the first emitted token is distributed as the target's p0,
    and the second, after an accepted first draft, as p1 (the target's next-token distribution
    given that draft)."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 6, 2
    sampling = _Sampling(temperature=1.0, top_p=1.0, top_k=0)
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 2
    p = sampling.probs(target_logits)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 2, dim=-1)
    torch.manual_seed(0)
    n = 5000  # L1 noise of the estimates about 0.02 (first) and 0.03 (second)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(n):
        drafts = torch.multinomial(q, 1)[:, 0]
        accepted, bonus = sampling.verify(drafts, q.unsqueeze(0), target_logits)
        emitted = drafts[:accepted].tolist() + [bonus]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
    assert (first / n - p[0]).abs().sum() < 0.06
    # the second token's distribution is p1 whatever the first draft was (p1 does not depend on it here)
    assert (second / second.sum() - p[1]).abs().sum() < 0.09


def test_greedy_verification_takes_the_longest_agreeing_prefix():
    sampling = _Sampling(temperature=0.0, top_p=1.0, top_k=0)
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 4, 9, 1]):
        logits[i, t] = 1.0
    assert sampling.verify(torch.tensor([3, 4, 5]), None, logits) == (2, 9)
    assert sampling.verify(torch.tensor([3, 4, 9]), None, logits) == (3, 1)
    assert sampling.verify(torch.tensor([0, 4, 9]), None, logits) == (0, 3)


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    top_k = _Sampling(1.0, 1.0, 2).probs(logits)[0]
    assert (top_k[2:] == 0).all() and top_k[:2].sum() == pytest.approx(1.0)
    top_p = _Sampling(1.0, 0.7, 0).probs(logits)[0]
    full = torch.softmax(logits[0], -1)
    assert full[0] < 0.7 <= full[:2].sum()
    assert (top_p[2:] == 0).all() and top_p[:2].sum() == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_sliding", "gemma3", "gpt_oss"])
def test_sliding_windows_and_scaled_embeddings_stay_lossless(family, default_assets, tmp_path, monkeypatch):
    """Targets with sliding-window layers (the cache is cut back after every block) and Gemma 3's
    scaled embedding: the output is the target's greedy output, and the block the served drafter
    gets is exactly the target's embedding module's output (what training fed it)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from dflash_core.checkpoint import save_checkpoint
    from dflash_core.config import DrafterConfig
    from dflash_core.drafter import DFlashDrafter
    from dflash_core.engine.warmup import serving_inputs
    from dflash_core.target import TargetModel
    from tests.test_serving_parity import parity_config

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    tok = AutoTokenizer.from_pretrained(str(default_assets.target))
    torch.manual_seed(0)
    target_dir = tmp_path / "target"
    AutoModelForCausalLM.from_config(parity_config(family, tok)).save_pretrained(str(target_dir))
    tok.save_pretrained(str(target_dir))
    ours = TargetModel(target_dir, [1, 2], "cpu")
    cfg = DrafterConfig.from_target_config(
        ours.config, num_hidden_layers=1, block_size=4, mask_token_id=5, target_layer_ids=[1, 2]
    )
    drafter = DFlashDrafter(serving_inputs(cfg, ours))
    drafter.init_weights(0)
    ckpt = save_checkpoint(tmp_path / "ckpt", drafter)

    draft = AutoModel.from_pretrained(str(ckpt), trust_remote_code=True).eval()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    seen = []
    draft.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(args[0] if args else kwargs), with_kwargs=True)
    prompt = torch.randint(6, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    out = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=24, stop_token_ids=[tok.eos_token_id])
    assert torch.equal(out, greedy(target, prompt, 24, tok.eos_token_id))
    block = torch.tensor([[int(out[0, 12])] + [5] * 3])
    with torch.no_grad():
        assert torch.equal(seen[0], target.get_input_embeddings()(block))
