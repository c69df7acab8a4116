"""The public reference against our DSpark checkpoint: SpecForge's own `DSparkDraftModel`
(specforge/modeling/draft/dspark.py at commit a6b6b023) loads a checkpoint the engine trained,
strictly (no missing or unexpected keys), and its `spec_generate` decodes held-out prompts
losslessly (the target's greedy output) in as many blocks as our evaluator, so with the same tau;
for each Markov head type (vanilla, gated, rnn). SpecForge's `spec_generate` decodes the fill_in
layout (it drafts from slots 1..B-1), so this checkpoint is trained fill_in: the test proves our
keys and the fill_in decode, not how the public stacks serve DSpark (anchor_first:
tests/test_dspark_served.py).

SpecForge is not a dependency (not installable in CI): the test runs when DFLASH_SPECFORGE_SRC
names a SpecForge source tree (the directory holding the `specforge` package), e.g.
`git clone https://github.com/sgl-project/SpecForge && git -C SpecForge checkout a6b6b023`, and is
skipped otherwise."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import assets_job, build_engine

SRC = os.environ.get("DFLASH_SPECFORGE_SRC")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SRC, reason="DFLASH_SPECFORGE_SRC (a SpecForge source tree) is not set"),
]


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_public_dspark_model_loads_and_decodes_our_checkpoint(default_assets, tmp_path, kind):
    sys.path.insert(0, str(SRC))
    from safetensors.torch import load_file
    from specforge.modeling.draft.dspark import DSparkDraftModel
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_core.checkpoint import load_drafter
    from dflash_core.data.conversations import read_conversations
    from dflash_core.engine import EngineConfig
    from dflash_core.evaluate import greedy_generate, prompt_ids, speculative_generate, stop_ids

    cfg = EngineConfig(drafter_devices=["cpu"], recipe="dspark", layout="fill_in", markov_head_type=kind)
    engine = build_engine(cfg, default_assets)
    try:
        res = engine.run_job(assets_job(default_assets, tmp_path, 60, learning_rate=3e-3))
        ck = Path(res.final_checkpoint)
        conf = json.loads((ck / "config.json").read_text())
        conf.pop("auto_map")
        qc = Qwen3Config(**conf)
        qc.dflash_config, qc.block_size = conf["dflash_config"], conf["block_size"]
        qc.num_target_layers = conf["num_target_layers"]
        qc._attn_implementation = "sdpa"
        public = DSparkDraftModel(qc).float().eval()
        public.load_state_dict(load_file(str(ck / "model.safetensors")), strict=True)
        target = AutoModelForCausalLM.from_pretrained(str(default_assets.target), dtype=torch.float32).eval()
        blocks = {"n": 0}
        forward = public.forward

        def counted(*a, **k):
            blocks["n"] += 1
            return forward(*a, **k)

        public.forward = counted
        ours, tok, stops = load_drafter(ck), engine.tokenizer, stop_ids(engine.tokenizer)
        head = engine.targets[0].frozen_head()
        for conv in list(read_conversations(default_assets.heldout))[:4]:
            prompt = prompt_ids(tok, conv.messages)
            mine = speculative_generate(engine.targets[0], ours, head, prompt, max_new_tokens=48, stop_token_ids=stops)
            greedy = greedy_generate(engine.targets[0], prompt, max_new_tokens=48, stop_token_ids=stops)
            blocks["n"] = 0
            out = public.spec_generate(
                target, torch.tensor([prompt]), max_new_tokens=48, stop_token_ids=sorted(stops), temperature=0.0
            )
            assert mine.tokens == greedy
            assert out[0, len(prompt) :].tolist() == greedy
            assert blocks["n"] == len(mine.acceptance_lengths)
    finally:
        engine.close()
