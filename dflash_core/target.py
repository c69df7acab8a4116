"""The frozen target LLM: loads an HF causal LM from a local path and captures the outputs of
selected decoder layers with forward hooks (never all hidden states). Packed documents are kept
apart with a block-diagonal causal mask and per-document position ids."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import nn

from .devices import compute_dtype
from .drafter import FrozenHead


class _StopForward(Exception):
    """Raised by the hook of the deepest captured layer: the layers after it are not needed."""


def block_causal_mask(doc_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, S, S] mask: causal within a document (padding, one doc id, is one more
    document: it never sees real tokens)."""
    s = doc_ids.shape[0]
    idx = torch.arange(s, device=doc_ids.device)
    allowed = (doc_ids.unsqueeze(1) == doc_ids.unsqueeze(0)) & (idx.unsqueeze(1) >= idx.unsqueeze(0))
    mask = torch.zeros(s, s, dtype=dtype, device=doc_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, s, s)


class TargetModel:
    def __init__(
        self,
        path: str | Path,
        layer_ids: list[int] | tuple[int, ...],
        device: str | torch.device,
        dtype: torch.dtype | None = None,
        random_init: bool = False,
        seed: int = 0,
    ):
        """random_init: build the architecture of `path`'s config.json with random weights,
        directly on the device (benchmarks and dry runs of large targets without their weights)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path = Path(path)
        self.device = torch.device(device)
        self.dtype = dtype or compute_dtype(self.device)
        if random_init:
            config = AutoConfig.from_pretrained(str(self.path))
            config._attn_implementation = "sdpa"
            torch.manual_seed(seed)
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=self.dtype, attn_implementation="sdpa")
        model.requires_grad_(False).eval().to(self.device)
        self.model = model
        self.config = model.config
        self.layer_ids = list(layer_ids)
        decoder_layers = self.decoder_layers()
        bad = [i for i in self.layer_ids if not 0 <= i < len(decoder_layers)]
        if bad:
            raise ValueError(f"target has {len(decoder_layers)} layers; cannot capture {bad}")
        self._local = threading.local()
        last = max(self.layer_ids)
        for i in sorted(set(self.layer_ids)):
            decoder_layers[i].register_forward_hook(self._make_hook(i, stop=(i == last)))

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.get_decoder().layers

    def _make_hook(self, layer_id: int, stop: bool):
        def hook(_module, _inputs, output):
            captured = getattr(self._local, "captured", None)
            if captured is None:
                return None
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if stop and getattr(self._local, "early_stop", False):
                raise _StopForward
            return None

        return hook

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def frozen_head(self) -> FrozenHead:
        return FrozenHead(self.model.get_input_embeddings().weight, self.model.get_output_embeddings().weight)

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """Features [S, n*H] of one packed sequence: concatenated outputs of the captured layers."""
        mask = block_causal_mask(doc_ids, self.dtype)
        self._local.captured = {}
        self._local.early_stop = True
        try:
            self.model.get_decoder()(
                input_ids=input_ids.unsqueeze(0),
                position_ids=position_ids.unsqueeze(0),
                attention_mask=mask,
                use_cache=False,
            )
        except _StopForward:
            pass
        finally:
            captured, self._local.captured = self._local.captured, None
        return torch.cat([captured[i][0] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain causal forward of one sequence [T]: (logits [T, V], features [T, n*H])."""
        self._local.captured = {}
        self._local.early_stop = False
        try:
            out = self.model(input_ids=input_ids.unsqueeze(0), use_cache=False)
        finally:
            captured, self._local.captured = self._local.captured, None
        return out.logits[0], torch.cat([captured[i][0] for i in self.layer_ids], dim=-1)
