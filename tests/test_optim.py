"""The engine's optimizer: TritonAdamW's kernel (run by Triton's interpreter on CPU) against
torch.optim.AdamW with clip_grad_norm_, checkpoint hand-over between them, and the CPU path's
clipped step."""

import pytest
import torch

from dflash_core.engine.optim import build_optimizer, clipped_step, load_optimizer_state

AGREEMENT = ("params", "exp_avg", "exp_avg_sq", "from_torch", "from_fused", "to_torch")


@pytest.mark.slow  # the Triton kernel in the (slow) interpreter
@pytest.mark.interpreted_check("tests.adamw_check")
def test_triton_adamw_matches_torch_adamw_interpreted(interpreted):
    diff = interpreted("tests.adamw_check")
    assert diff["step_on_host"] and diff["loaded_step_on_host"] and diff["to_torch_keeps_its_implementation"]
    for key in AGREEMENT:  # fp32 rounding: ~1e-7; decay applied after the update instead: ~1e-3
        assert diff[key] < 1e-6, (key, diff)
    # fp32 masters updated from bf16 gradients on their bf16 working copies, which get the new
    # master rounded (the interpreter truncates instead of rounding: within one bf16 ulp)
    working = diff["working_copies"]
    assert working["copies"] == 2 and working["masters"] < 1e-6 and working["exp_avg"] < 1e-6, working
    assert working["copy_ulps_from_rounded_master"] <= 1.0, working


def test_working_copies_are_checked():
    triton = pytest.importorskip("triton")  # noqa: F841
    from dflash_core.kernels.adamw import TritonAdamW

    p = torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="working cop"):
        TritonAdamW([p], working_copies=[])
    with pytest.raises(ValueError, match="working copy must be"):
        TritonAdamW([p], working_copies=[torch.zeros(3, 4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="working copy must be"):
        TritonAdamW([p], working_copies=[torch.zeros(4, 3)])  # fp32: not a working copy
    with pytest.raises(ValueError, match="Triton AdamW"):
        build_optimizer(
            [p], 1e-3, 0.0, (0.9, 0.95), torch.device("cpu"), working_copies=[torch.zeros(4, 3, dtype=torch.bfloat16)]
        )


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clipped_step_equals_clip_grad_norm_then_step(max_norm):
    def make():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(8, 5)), torch.nn.Parameter(torch.randn(5))]
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps

    ours_p, ref_p = make(), make()
    ours = build_optimizer(ours_p, 1e-2, 0.1, (0.9, 0.95), torch.device("cpu"))
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    norm = clipped_step(ours, [p.grad for p in ours_p], max_norm)
    # with clipping off the norm is still the one measured, never a constant
    unclipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref_p]))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_p, max_norm) if max_norm > 0 else unclipped
    ref.step()
    assert torch.allclose(norm, ref_norm)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b)


def test_resumed_torch_adamw_keeps_its_own_implementation():
    # a checkpoint's param groups replace the loader's; its fused/foreach switches must not
    saver_p, loader_p = [torch.nn.Parameter(torch.randn(4))], [torch.nn.Parameter(torch.randn(4))]
    saver = torch.optim.AdamW(saver_p, foreach=False)
    saver_p[0].grad = torch.randn(4)
    saver.step()
    loader = torch.optim.AdamW(loader_p, foreach=True)
    load_optimizer_state(loader, saver.state_dict())
    assert loader.param_groups[0]["foreach"] is True
    assert torch.equal(loader.state[loader_p[0]]["exp_avg"], saver.state[saver_p[0]]["exp_avg"])


def test_triton_adamw_refuses_what_its_kernel_cannot_update():
    pytest.importorskip("triton")
    from dflash_core.kernels.adamw import TritonAdamW

    with pytest.raises(ValueError, match="fp32"):
        TritonAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="contiguous"):
        TritonAdamW([torch.nn.Parameter(torch.zeros(4, 6).t())])
    with pytest.raises(ValueError, match="betas"):
        TritonAdamW([torch.nn.Parameter(torch.zeros(4))], betas=(0.9, 1.0))
    ams = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad"):
        TritonAdamW([torch.nn.Parameter(torch.zeros(4))]).load_state_dict(ams)
