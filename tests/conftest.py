import os
from pathlib import Path

import pytest
import torch

# Inductor's first CPU compile in a cache directory builds and loads a test library per vector
# instruction set the CPU reports (about 10 s on 2 cores), to drop those the compiler cannot build.
# The suite's processes compile into fresh cache directories (a test's data dir, a clean CI
# machine's), so each would pay it; the test machines' compilers build them all, and inductor
# picks the same instruction set without the probe.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core: each worker, and the daemons and ranks it starts
    # (they inherit the variable), computes on one thread instead of contending for both cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def _shares_a_module_fixture(item) -> bool:
    # the fixtures a test uses, with their scopes (pytest keeps them on the item, not publicly)
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope == "module" for d in defs)


# tryfirst: before pytest-xdist's own hook, which reads the xdist_group marks
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        # the tests of a module that share a module-scoped fixture (a daemon, a trained drafter, an
        # interpreted check's run) form one group, which `--dist loadgroup` (pyproject.toml) sends
        # to one worker: split over two, each worker would build the fixture
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
        # so do the tests of the interpreted checks, which share one run (`interpreted`)
        elif item.get_closest_marker("interpreted_check") is not None:
            item.add_marker(pytest.mark.xdist_group("interpreted-checks"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def interpreted(request):
    """interpreted(module, *flags) -> that check's result (tests/interpreted_checks.py): the
    checks named by the `interpreted_check` marks of the tests selected, all run once, in one
    fresh interpreter with Triton's interpreter."""
    pytest.importorskip("triton")
    from tests.helpers import run_interpreted_check

    checks = {" ".join(m.args) for item in request.session.items for m in item.iter_markers("interpreted_check")}
    results = run_interpreted_check("tests.interpreted_checks", *sorted(checks))

    def result(*check: str) -> dict:
        got = results[" ".join(check)]
        assert "error" not in got, got["error"]
        return got["result"]

    return result


@pytest.fixture(scope="session")
def assets_dir(tmp_path_factory) -> Path:
    from dflash_core.defaults import ensure_default_assets

    return ensure_default_assets(tmp_path_factory.mktemp("data")).root


@pytest.fixture(scope="session")
def default_assets(assets_dir):
    from dflash_core.defaults import ensure_default_assets

    return ensure_default_assets(assets_dir.parent.parent)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The default word-level tokenizer, built from the synthetic corpus (no trained target needed)."""
    from transformers import AutoTokenizer

    from dflash_core.defaults.synthetic import corpus_words
    from dflash_core.defaults.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(corpus_words(), out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="session")
def random_target_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny Qwen3 with random weights (6 layers) saved as a real HF checkpoint."""
    from transformers import Qwen3ForCausalLM

    from dflash_core.defaults.target import tiny_qwen3_config

    torch.manual_seed(0)
    cfg = tiny_qwen3_config(len(tokenizer), num_hidden_layers=6, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(cfg)
    out = tmp_path_factory.mktemp("random_target")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def target_tokenizer(default_assets):
    """The embedded default target's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_assets.target))
