"""Acceptance-length evaluation: lossless speculative decoding, tau of untrained vs trained
drafters, and tau against an independent, cache-free reimplementation."""

import random

import pytest
import torch

from dflash_core.config import DrafterConfig
from dflash_core.data.conversations import read_conversations
from dflash_core.defaults import (
    DEFAULT_DRAFTER_LAYERS,
    DEFAULT_SHAPE_CPU,
    DEFAULT_TARGET_LAYER_IDS,
    DEFAULT_TRAIN_STEPS,
)
from dflash_core.defaults.synthetic import make_example
from dflash_core.drafter import DFlashDrafter
from dflash_core.engine import Engine, EngineConfig, TrainJob
from dflash_core.evaluate import evaluate_acceptance, greedy_generate, prompt_ids, speculative_generate, stop_ids
from dflash_core.step.micro_step import inference_block_forward
from dflash_core.target import TargetModel


@pytest.fixture(scope="module")
def engine(default_assets):
    shape = DEFAULT_SHAPE_CPU
    cfg = EngineConfig(
        drafter_devices=["cpu"],
        seq_len=shape.seq_len,
        num_anchors=shape.num_anchors,
        block_size=shape.block_size,
        drafter_layers=DEFAULT_DRAFTER_LAYERS,
        target_layer_ids=list(DEFAULT_TARGET_LAYER_IDS),
    )
    eng = Engine(cfg, default_assets.root.parent.parent).build()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def trained(engine, default_assets, tmp_path_factory):
    """A drafter after the embedded default's short training job (a few CPU minutes at most)."""
    job = TrainJob(
        datasets=[str(default_assets.train)],
        output_dir=str(tmp_path_factory.mktemp("trained")),
        steps=DEFAULT_TRAIN_STEPS,
        checkpoint_interval=DEFAULT_TRAIN_STEPS,
        learning_rate=3e-3,
    )
    engine.run_job(job)
    return engine.replicas[0].drafter


@pytest.fixture(scope="module")
def untrained(engine):
    d = DFlashDrafter(engine.drafter_config)
    d.init_weights(seed=11)
    return d


@pytest.fixture(scope="module")
def heldout(default_assets):
    return list(read_conversations(default_assets.heldout))


def random_prompts(tokenizer, n, seed):
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2:
            user, _ = make_example(rng)
        else:  # arbitrary words, not from the task templates
            user = " ".join(rng.choices(list(tokenizer.get_vocab())[6:60], k=rng.randrange(2, 8)))
        prompts.append(prompt_ids(tokenizer, [{"role": "user", "content": user}]))
    return prompts


# the trained drafter: the embedded default training job on the CPU (about 20 s on 2 cores)
@pytest.mark.parametrize("which", ["untrained", pytest.param("trained", marks=pytest.mark.slow)])
def test_speculative_decoding_is_lossless(engine, which, request):
    drafter = request.getfixturevalue(which)
    target, tok = engine.targets[0], engine.tokenizer
    head = engine.replicas[0].head
    stops = stop_ids(tok)
    for prompt in random_prompts(tok, 6, seed=5):
        spec = speculative_generate(target, drafter, head, prompt, max_new_tokens=32, stop_token_ids=stops)
        assert spec.tokens == greedy_generate(target, prompt, max_new_tokens=32, stop_token_ids=stops)
        assert sum(spec.acceptance_lengths) >= len(spec.tokens) - 1


def test_untrained_tau_is_close_to_one(engine, untrained, heldout):
    tau = evaluate_acceptance(
        engine.targets[0], untrained, engine.tokenizer, heldout[:16], max_new_tokens=48
    ).acceptance_length
    assert 1.0 <= tau < 1.3, tau


def test_the_tokenizer_is_taken_per_use_and_free_while_decoding(engine, untrained, heldout, monkeypatch):
    """With a tokenizer_turn (a continual job's TokenizerTurns.first), evaluate_acceptance holds
    it around each call of the tokenizer and not while the target and drafter decode: another
    thread's turn at the tokenizer (the job's ingest) goes through during each decode. The
    result is the one without turns."""
    import threading

    from dflash_core import evaluate as ev
    from dflash_core.continual.turns import TokenizerTurns

    turns, calls, others = TokenizerTurns(), [], []
    tok = engine.tokenizer

    class Watched:
        """The real tokenizer; each call of it and each read of its attributes (an id such as
        eos_token_id is looked up through the tokenizer) notes whether the caller held a turn."""

        def __call__(self, *args, **kwargs):
            calls.append(turns._holder == threading.get_ident())
            return tok(*args, **kwargs)

        def __getattr__(self, name):
            calls.append(turns._holder == threading.get_ident())
            attr = getattr(tok, name)
            if not callable(attr):
                return attr

            def call(*args, **kwargs):
                calls.append(turns._holder == threading.get_ident())
                return attr(*args, **kwargs)

            return call

    generate = ev.speculative_generate

    def take_a_turn():
        with turns.turn():
            pass

    def decode_beside_another_turn(*args, **kwargs):
        other = threading.Thread(target=take_a_turn, daemon=True)
        other.start()
        other.join(timeout=5)
        others.append(not other.is_alive())
        return generate(*args, **kwargs)

    monkeypatch.setattr(ev, "speculative_generate", decode_beside_another_turn)
    target, prompts = engine.targets[0], heldout[:3]
    plain = evaluate_acceptance(target, untrained, tok, prompts, max_new_tokens=8)
    others.clear()
    taken = evaluate_acceptance(target, untrained, Watched(), prompts, max_new_tokens=8, tokenizer_turn=turns.first)
    assert others == [True] * 3  # each decode: another thread took a turn meanwhile
    assert len(calls) >= 6 and all(calls), calls  # every tokenizer call inside a turn
    assert taken.acceptance_lengths == plain.acceptance_lengths and taken.samples == plain.samples


@pytest.mark.slow  # needs the trained drafter (the default training job)
def test_trained_tau_on_heldout_prompts(engine, trained, heldout):
    result = evaluate_acceptance(engine.targets[0], trained, engine.tokenizer, heldout[:32], max_new_tokens=48)
    print(f"held-out tau after {DEFAULT_TRAIN_STEPS} steps: {result.acceptance_length:.2f}")
    assert result.acceptance_length >= 3.0, result.summary()


def independent_tau(target: TargetModel, drafter: DFlashDrafter, embed, lm_head, tokenizer, prompt, max_new, layer_ids):
    """Plain re-implementation: full-sequence HF forwards with output_hidden_states, no caches,
    none of the evaluator's code."""
    model = target.model
    cfg: DrafterConfig = drafter.config

    def run(ids):
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        return out.logits[0], feats

    logits, feats = run(prompt)
    seq = prompt + [int(logits[-1].argmax())]
    lengths = []
    while len(seq) - len(prompt) < max_new and seq[-1] != tokenizer.eos_token_id:
        a = len(seq) - 1
        block = torch.tensor([seq[a]] + [cfg.mask_token_id] * (cfg.block_size - 1))
        from dflash_core.drafter import FrozenHead

        h = inference_block_forward(drafter, FrozenHead(embed, lm_head), feats[:a], block, a)
        guess = (h[1:] @ lm_head.t()).argmax(-1).tolist()
        logits, feats_all = run(seq + guess)
        n = 0
        for i, g in enumerate(guess):
            if int(logits[a + i].argmax()) != g:
                break
            n += 1
        added = guess[:n] + [int(logits[a + n].argmax())]
        seq = seq + added
        feats = feats_all
        lengths.append(n + 1)
        if tokenizer.eos_token_id in added:
            break
    return lengths


@torch.no_grad()
@pytest.mark.slow  # needs the trained drafter (the default training job)
def test_tau_matches_independent_reimplementation(engine, trained, heldout):
    target, tok = engine.targets[0], engine.tokenizer
    head = engine.replicas[0].head
    ours, theirs = [], []
    for conv in heldout[:8]:
        prompt = prompt_ids(tok, conv.messages)
        ours += speculative_generate(
            target, trained, head, prompt, max_new_tokens=40, stop_token_ids=stop_ids(tok)
        ).acceptance_lengths
        theirs += independent_tau(
            target, trained, head.embed_weight, head.lm_head_weight, tok, prompt, 40, list(DEFAULT_TARGET_LAYER_IDS)
        )
    assert ours == theirs
    assert sum(ours) / len(ours) == pytest.approx(sum(theirs) / len(theirs))


@pytest.mark.slow  # needs the trained drafter (the default training job)
def test_eval_cli_prints_tau(engine, trained, default_assets, tmp_path, capsys):
    from dflash_core.checkpoint import save_checkpoint
    from service.cli import main

    ckpt = save_checkpoint(tmp_path / "ckpt", trained, metadata={"target": str(default_assets.target)})
    rc = main(
        [
            "eval",
            "--checkpoint",
            str(ckpt),
            "--prompts",
            str(default_assets.heldout),
            "--max-prompts",
            "4",
            "--max-new-tokens",
            "32",
            "--data-dir",
            str(tmp_path),
            "--check-lossless",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    tau = float(out.split("tau (mean acceptance length) = ")[1].split()[0])
    assert tau >= 2.0 and "accepted per block" in out
    assert "outputs differing from target-only greedy decoding: 0" in out
    assert main(["eval", "--checkpoint", str(tmp_path / "missing"), "--prompts", str(default_assets.heldout)]) == 2
