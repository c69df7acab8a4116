import pytest
import torch

from dflash_core.devices import CudaContexts


def test_cuda_contexts_hand_the_side_threads_error_to_the_caller():
    if torch.cuda.is_available():
        pytest.skip("needs a host without CUDA: the error path")
    contexts = CudaContexts(["cpu", "cuda:0"])
    assert contexts.devices == ["cuda:0"]
    with pytest.raises((RuntimeError, AssertionError)):  # torch: "not compiled with CUDA" / no device
        contexts.wait()


def test_cuda_contexts_without_cuda_devices_start_nothing():
    contexts = CudaContexts(["cpu", "cpu"])
    assert contexts.devices == []
    contexts.wait()  # returns at once
