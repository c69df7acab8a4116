import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each GPU test compiles from dynamo's empty in-memory cache, in its default stance. Dynamo
    keys compiled code by code object for the whole process: the entries earlier tests left for
    `run_layer` (other shapes, FP8 linears) count against the recompile limit an engine sets for
    its own devices, and past it dynamo runs the frame eagerly without a word: the step graph is
    not recorded and the drafter threads trace flex_attention eagerly together. A daemon builds
    one engine per process and never meets this."""
    torch.compiler.set_stance("default")
    torch._dynamo.reset()
    yield
