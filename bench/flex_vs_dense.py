"""Compiled flex_attention (bf16) against the dense SDPA reference (fp32) on CUDA, forward and
backward, at the reference widths: relative error of the outputs and of every parameter gradient.

    python -m bench.flex_vs_dense [--layers 2] [--seq-len 3072] [--anchors 512]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import add_shape_arguments, env_record, out_dir, print_table, reference_drafter_config
from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.drafter import DFlashDrafter, FrozenHead
from dflash_core.engine.config import step_plan
from dflash_core.engine.replica import make_bf16_working_copies, plan_kernels
from dflash_core.step.micro_step import EAGER, StepKernels, StepSettings, drafter_forward, micro_step, step_attention


def run(layers=2, seq_len=3072, anchors=512, block=16, seed=0):
    cfg = reference_drafter_config(layers)
    shape = ShapeConfig(seq_len=seq_len, num_anchors=anchors, block_size=block)
    g = torch.Generator(device="cuda").manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g) * 0.02
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g) * 0.02
    feats = torch.randn(seq_len, cfg.num_target_features * cfg.hidden_size, device="cuda", generator=g)
    batch = synthetic_micro_batch(shape, cfg.vocab_size, 0, seed=seed).to("cuda")
    base = DFlashDrafter(cfg)
    base.init_weights(seed)
    results = {}
    flex_alone = StepKernels(attention=True)
    # the engine's CUDA step: compiled layer and BlockMask, the Triton CE kernel for the loss chunks,
    # and bf16 working copies of the weight matrices (below)
    flex_layer = plan_kernels(step_plan(["cuda:0"]))
    for name, attention, dtype, kernels in (
        ("dense_fp32", "dense", torch.float32, EAGER),
        ("flex_bf16", "flex", torch.bfloat16, flex_alone),
        ("flex_layer_bf16", "flex", torch.bfloat16, flex_layer),
        ("dense_bf16", "dense", torch.bfloat16, EAGER),
    ):
        drafter = DFlashDrafter(cfg).cuda()
        drafter.load_state_dict(base.state_dict())
        if kernels is flex_layer:  # as DrafterReplica's bf16 working weights: the matrices in bf16, norms fp32
            make_bf16_working_copies(list(drafter.parameters()))
        head = FrozenHead(embed, lm_head).to("cuda", dtype)
        ctx = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if dtype == torch.bfloat16
            else torch.autocast("cuda", enabled=False)
        )
        with ctx:
            res = micro_step(drafter, head, batch, feats.to(dtype), StepSettings(attention, 7.0, 2048, kernels))
            with torch.no_grad():
                hidden = drafter_forward(
                    drafter, head, batch, feats.to(dtype), step_attention(batch, block, attention, kernels), kernels
                )
        res.loss.backward()
        results[name] = {
            "loss": res.loss.detach().float(),
            "hidden": hidden.detach().float(),
            "grads": {k: p.grad.detach().float() for k, p in drafter.named_parameters()},
        }
        del drafter
        torch.cuda.empty_cache()
    ref = results["dense_fp32"]
    rows = []
    for name in ("flex_bf16", "flex_layer_bf16", "dense_bf16"):
        r = results[name]
        rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
        grads = {k: rel(r["grads"][k], ref["grads"][k]) for k in ref["grads"]}
        worst = max(grads, key=grads.get)
        rows.append(
            {
                "variant": name,
                "loss_rel": f"{rel(r['loss'], ref['loss']):.2e}",
                "hidden_rel": f"{rel(r['hidden'], ref['hidden']):.2e}",
                "grad_rel_max": f"{grads[worst]:.2e}",
                "grad_worst": worst,
                "grad_rel_median": f"{sorted(grads.values())[len(grads) // 2]:.2e}",
                "grads": grads,
            }
        )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    add_shape_arguments(p)
    args = p.parse_args(argv)
    rows = run(args.layers, args.seq_len, args.anchors)
    (out_dir() / "flex_vs_dense.json").write_text(
        json.dumps({"env": env_record(), "args": vars(args), "rows": rows}, indent=1)
    )
    print(
        f"flex (bf16, compiled) and dense SDPA (bf16) vs dense SDPA fp32; {args.layers} layers, S={args.seq_len}, N={args.anchors}, B=16"
    )
    print_table(rows, ["variant", "loss_rel", "hidden_rel", "grad_rel_median", "grad_rel_max", "grad_worst"])


if __name__ == "__main__":
    main()
