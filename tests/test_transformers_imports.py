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
