"""transformers' model classes import scikit-learn wherever it is installed; the daemon's build and
its compile child import them without it (transformers_imports.py). A stand-in scikit-learn on the
path (a package that transformers finds) stands for an image that carries the real one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fake_sklearn(root: Path) -> Path:
    pkg = root / "sklearn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "metrics.py").write_text("def roc_curve(*args, **kwargs):\n    raise AssertionError('not called')\n")
    return root


def run(code: str, path: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), str(REPO)]))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_transformers_model_classes_import_scikit_learn_where_it_is_installed(tmp_path):
    """The control: without the skip, a model class's import pulls scikit-learn in (were it not
    so, skip_unused_imports would have nothing left to do)."""
    out = run(
        """
        import sys
        import transformers.models.qwen3.modeling_qwen3
        print('sklearn.metrics' in sys.modules)
        """,
        fake_sklearn(tmp_path),
    )
    assert out == "True"


def test_the_compile_child_and_the_build_import_transformers_without_scikit_learn(tmp_path):
    out = run(
        """
        import sys
        from dflash_core.engine import side_compile_child
        from dflash_core.transformers_imports import skip_unused_imports
        side_compile_child.prepare()  # what the child imports before its spec comes
        assert 'transformers.models.qwen3.modeling_qwen3' in sys.modules
        print('sklearn' in sys.modules, skip_unused_imports())
        from transformers import AutoModelForCausalLM, Qwen3Config
        model = AutoModelForCausalLM.from_config(Qwen3Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, vocab_size=64))
        print('sklearn' in sys.modules, type(model).__name__)
        """,
        fake_sklearn(tmp_path),
    )
    # no scikit-learn, and a second call finds the generation utilities already imported
    assert out.splitlines() == ["False False", "False Qwen3ForCausalLM"]


def test_the_engine_build_skips_scikit_learn_before_it_imports_transformers(tmp_path):
    """The build's first step: a build that fails on a missing target has already imported
    transformers' tokenizer classes, and a model class imported after it comes without
    scikit-learn."""
    out = run(
        f"""
        import sys
        from dflash_core.devices import CudaContexts
        from dflash_core.engine.config import EngineConfig
        from dflash_core.engine.warmup import Timeline, build
        config = EngineConfig(drafter_devices=["cpu"], target_devices=["cpu"], target_path={str(tmp_path / "none")!r})
        try:
            build(config, {str(tmp_path)!r}, Timeline(1, lambda *a: None), CudaContexts([]))
        except Exception as e:
            print(type(e).__name__, 'transformers.models.auto' in sys.modules)
        import transformers.models.qwen3.modeling_qwen3
        print('sklearn' in sys.modules)
        """,
        fake_sklearn(tmp_path / "site"),
    )
    first, second = out.splitlines()[-2:]
    assert first.endswith(" True"), out  # the build got as far as transformers' auto classes
    assert second == "False"
