"""The embedded default: a tiny trained Qwen3-architecture target with its tokenizer (chat
template, mask token) and a bundled synthetic conversation dataset. Shipped under `assets/`
(rebuilt by `python -m dflash_core.defaults.build`) and copied into the data directory on first
use. Never touches the network."""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..config import ShapeConfig
from ..data_home import ASSETS_DIR

ASSETS = Path(__file__).parent / "assets"
ASSETS_VERSION = "v2"  # bump whenever assets/ changes: data dirs keep a copy per version


@dataclass(frozen=True)
class DefaultAssets:
    root: Path
    target: Path  # HF model dir with tokenizer
    train: Path  # JSONL conversations
    heldout: Path  # JSONL conversations not in train


def ensure_default_assets(data_dir: str | Path) -> DefaultAssets:
    """Copy the bundled assets into `<data_dir>/defaults/<version>` (atomically, once)."""
    root = Path(data_dir) / ASSETS_DIR / ASSETS_VERSION
    if not (root / "train.jsonl").is_file():
        if not (ASSETS / "train.jsonl").is_file():
            raise FileNotFoundError(
                f"bundled default assets missing under {ASSETS}; run python -m dflash_core.defaults.build"
            )
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = root.parent / f".tmp-{uuid.uuid4().hex[:8]}"
        shutil.copytree(ASSETS, tmp)
        try:
            os.rename(tmp, root)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return DefaultAssets(root, root / "target", root / "train.jsonl", root / "heldout.jsonl")


# The embedded default's fixed shapes on CPU: 512 packed tokens, 64 blocks of 8 (Q = 512, KV = 1024).
DEFAULT_SHAPE_CPU = ShapeConfig(seq_len=512, num_anchors=64, block_size=8)
# The tiny target has 4 layers; the reference rule would pick layer 1 twice for 2 draft layers.
DEFAULT_TARGET_LAYER_IDS = (1, 2)
DEFAULT_DRAFTER_LAYERS = 2
# Steps of the embedded default's short training job: enough for held-out tau to clear 3 with a
# margin (tests/test_evaluate.py asserts it), short enough for the CPU test suite.
DEFAULT_TRAIN_STEPS = 250
