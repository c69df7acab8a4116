"""Small builders shared by tests (real components, tiny sizes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_core.config import DrafterConfig, ShapeConfig
from dflash_core.data.batches import MicroBatch, make_micro_batch
from dflash_core.data.packing import pack_documents
from dflash_core.data.tokenize import Document
from dflash_core.drafter import DFlashDrafter

REPO_ROOT = Path(__file__).resolve().parents[1]


def tiny_drafter_config(
    vocab_size=64, block_size=4, hidden=32, heads=4, kv_heads=2, n_features=2, layers=2, mask_token_id=1
):
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab_size,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(range(1, 1 + n_features)),
        num_target_layers=n_features + 2,
        rope_theta=10000.0,
    )


def random_documents(rng: np.random.Generator, n_docs: int, min_len=4, max_len=20, vocab=64, p_loss=0.6):
    docs = []
    for i in range(n_docs):
        n = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(2, vocab, size=n)
        mask = rng.random(n) < p_loss
        docs.append(Document(ids.astype(np.int64), mask, f"rand:{i}"))
    return docs


def random_micro_batch(rng: np.random.Generator, shape: ShapeConfig, vocab=64, n_docs=4) -> MicroBatch:
    docs = random_documents(rng, n_docs, max_len=max(4, shape.seq_len // n_docs), vocab=vocab)
    seqs = pack_documents(docs, shape.seq_len, pad_token_id=0)
    return make_micro_batch(seqs[0], shape, rng, 0)


def random_drafter(cfg: DrafterConfig, seed=0) -> DFlashDrafter:
    d = DFlashDrafter(cfg)
    d.init_weights(seed, std=0.2)
    return d.double()


def mount_tmpfs(path, options: str) -> None:
    """A small tmpfs at `path` (mount options such as "size=2m" or "size=1m,ro"): a real full or
    read-only file system. Needs root on Linux; skips the test where the machine cannot mount one."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")


def unmount(path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 120, drop: tuple[str, ...] = ("DFLASH_",)
) -> subprocess.CompletedProcess:
    """`python -m service.cli ARGS` in a fresh interpreter, as a user runs it: this checkout first
    on the path, and none of the environment variables whose names start with `drop`. A path the
    caller already has stays after the checkout: where the packages were installed with `pip
    --target` (bench/gpu_session.sh does so), the interpreter finds them only there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def saved_models(tmp_path_factory, tokenizer, config_of) -> Callable[[str], Path]:
    """name -> the directory of a tiny random model with config_of(name, tokenizer), saved by
    transformers with the tokenizer; each name is built once."""
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config_of(name, tokenizer))
            out = tmp_path_factory.mktemp(name)
            model.save_pretrained(str(out))
            tokenizer.save_pretrained(str(out))
            made[name] = out
        return made[name]

    return make


def train_spec(assets, output_dir, steps: int, *, checkpoint_interval: int | None = None, **extra) -> dict:
    """A training job on the default train split (learning rate 3e-3, seed 1) checkpointing every
    `checkpoint_interval` steps (default: at the end)."""
    return dict(
        datasets=[str(assets.train)],
        output_dir=str(output_dir),
        steps=steps,
        learning_rate=3e-3,
        checkpoint_interval=checkpoint_interval or steps,
        seed=1,
        **extra,
    )


def run_code(code: str, *args: str, env: dict[str, str], timeout: float = 300) -> dict:
    """`python -c CODE ARGS` in a fresh interpreter, in this checkout, with `env`; the JSON object
    on the last line of its output."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_interpreted_check(module: str, *args: str) -> dict:
    """`python -m MODULE ARGS` with TRITON_INTERPRET=1 (read when a kernel module is imported, so it
    takes a fresh interpreter); the check's result, the JSON object on its last line."""
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def heldout_prompt_ids(path, tok, count: int) -> list[list[int]]:
    """Token ids of the first `count` conversations of `path`, each up to its last user turn, as the
    chat template renders them with the generation prompt."""
    out = []
    with open(path) as f:
        for line in list(f)[:count]:
            messages = json.loads(line)["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "user")
            text = tok.apply_chat_template(messages[: last + 1], tokenize=False, add_generation_prompt=True)
            out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def small_engine_config(**settings):
    """The CPU engine of the end-to-end tests: the shipped drafter depth and target layers on short
    sequences; `settings` add to or replace these."""
    from dflash_core.defaults import DEFAULT_DRAFTER_LAYERS, DEFAULT_TARGET_LAYER_IDS
    from dflash_core.engine import EngineConfig

    base = dict(
        drafter_devices=["cpu"],
        seq_len=256,
        num_anchors=32,
        drafter_layers=DEFAULT_DRAFTER_LAYERS,
        target_layer_ids=list(DEFAULT_TARGET_LAYER_IDS),
    )
    return EngineConfig(**{**base, **settings})


def build_engine(cfg, assets):
    """An engine built on the data directory that holds the default assets."""
    from dflash_core.engine import Engine

    return Engine(cfg, assets.root.parent.parent).build()


def assets_job(assets, output_dir, steps: int, *, eval_prompts: int = 0, eval_new_tokens: int = 0, **extra):
    """A TrainJob on the default train split checkpointing at its last step; with eval_prompts, it
    also evaluates that many held-out prompts (eval_new_tokens each) at its last step."""
    from dflash_core.engine import TrainJob

    if eval_prompts:
        extra.update(
            eval_prompts=str(assets.heldout),
            eval_interval=steps,
            eval_max_prompts=eval_prompts,
            eval_max_new_tokens=eval_new_tokens,
        )
    return TrainJob(
        datasets=[str(assets.train)], output_dir=str(output_dir), steps=steps, checkpoint_interval=steps, **extra
    )


def write_tiny_qwen3(out: Path, seed: int = 0) -> Path:
    """A tiny bf16 Qwen3 causal LM with random weights saved in `out` (4 layers, hidden 128)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, max_position_embeddings=256,
    )  # fmt: skip
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def write_fp8_checkpoint(bf16_dir: Path, out: Path, block: int = 128) -> Path:
    """The bf16 checkpoint in `bf16_dir` stored as fine-grained FP8, the way FP8 releases of
    Qwen3 and DeepSeek are: every decoder linear weight e4m3 with an fp32 `weight_scale_inv` per
    block x block tile (edge tiles partial), everything else as it was, config.json's
    quantization_config, and the directory's other files (tokenizer, chat template) copied."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(bf16_dir / "model.safetensors"))
    fmax = torch.finfo(torch.float8_e4m3fn).max
    stored = {}
    for key, value in state.items():
        if key.startswith("model.layers.") and key.endswith("proj.weight"):
            rows, cols = value.shape
            r, c = -(-rows // block), -(-cols // block)
            tiles = torch.nn.functional.pad(value.float(), (0, c * block - cols, 0, r * block - rows))
            tiles = tiles.reshape(r, block, c, block)
            inv = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fmax
            q = (tiles / inv[:, None, :, None]).to(torch.float8_e4m3fn).reshape(r * block, c * block)
            stored[key], stored[key[: -len("weight")] + "weight_scale_inv"] = q[:rows, :cols].contiguous(), inv
        else:
            stored[key] = value
    out.mkdir()
    save_file(stored, str(out / "model.safetensors"))
    for f in bf16_dir.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (out / "config.json").write_text(json.dumps(config))
    return out
