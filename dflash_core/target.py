"""The frozen target LLM: loads an HF causal LM from a local path and captures the outputs of
selected decoder layers with forward hooks (never all hidden states). Packed documents are kept
apart with per-document masks and position ids (`packed_masks`)."""

from __future__ import annotations

import contextlib
import copy
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .devices import compute_dtype
from .drafter import FrozenHead
from .parity import input_embedding_scale, scaled_table
from .target_attention import use_packed_attention
from .target_fusion import LayerFusion, fused_tolerance
from .target_norms import NormKernels
from .target_qkv import QkvDispatch
from .target_rope import install as install_rope_dispatch


class _StopForward(Exception):
    """Raised by the hook of the deepest captured layer: the layers after it are not needed."""


def attention_implementation(config: Any) -> str:
    """The target's attention: SDPA where its model class has it, else eager (gpt-oss: its
    attention sinks enter the softmax, which SDPA has no input for). Never a flash / varlen
    kernel: those drop the 4D masks that keep packed documents apart."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # not a causal LM transformers knows: loading says why
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def mask_layer_types(config: Any) -> list[str]:
    """The attention pattern of each decoder layer, as the model's own forward chooses it:
    `layer_types` where the config has them (Qwen3, Qwen2, gpt-oss, ...); otherwise one pattern
    for every layer, sliding where the config sets a `sliding_window` (Mistral, Qwen3-MoE and
    others that pick create_sliding_window_causal_mask by it), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [pattern] * int(config.num_hidden_layers)


def packed_masks(
    config: Any, doc_ids: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | dict[str, Any]:
    """The attention masks of one packed sequence [S]: for each layer pattern, the model's own
    mask (built by transformers' mask builders for its attention implementation: a boolean mask
    for SDPA, an additive one for eager, ...) ANDed with "same document" (padding, one doc id, is
    one more document: it never sees real tokens).

    Why not one 4D mask: a 4D mask is used as given by every layer, so the sliding-window layers
    of gpt-oss or Qwen3 (`layer_types`) would attend over the whole document. Why not transformers'
    packed-sequence detection (no mask, position ids that restart): only some models pass position
    ids to their mask builders (gpt-oss does not), and doc_ids, not position jumps, are what says
    where a document ends. So: one mask per layer pattern, handed over as the dict
    {layer type: mask} that models with mixed layer types take in place of attention_mask (what
    `generate` passes them), or as the one mask where all layers share a pattern (what every model
    takes). Sliding windows count packed indices, which within one document are its positions;
    chunked attention (Llama 4) counts chunks from each document's start, so its overlay reads
    the position ids."""
    from transformers import masking_utils

    additive = getattr(config, "_attn_implementation", None) == "eager"
    if additive:  # see _additive
        config = copy.copy(config)
        config._attn_implementation = "sdpa"
    doc = doc_ids.view(1, -1)
    pos = position_ids.view(1, -1)

    def same_doc(batch_idx, head_idx, q_idx, kv_idx):
        return doc[batch_idx, q_idx] == doc[batch_idx, kv_idx]

    # read by the builders for its batch size, length, dtype and device only
    shape_of = torch.empty((1, doc_ids.shape[0], 0), dtype=dtype, device=doc_ids.device)
    kw = dict(config=config, inputs_embeds=shape_of, attention_mask=None, past_key_values=None)
    masks: dict[str, Any] = {}
    for kind in dict.fromkeys(mask_layer_types(config)):
        if kind == "full_attention":
            masks[kind] = masking_utils.create_causal_mask(**kw, and_mask_function=same_doc)
        elif kind == "sliding_attention":
            masks[kind] = masking_utils.create_sliding_window_causal_mask(**kw, and_mask_function=same_doc)
        elif kind == "chunked_attention":
            chunk = int(config.attention_chunk_size)

            def same_doc_and_chunk(batch_idx, head_idx, q_idx, kv_idx, chunk=chunk):
                same_chunk = pos[batch_idx, q_idx] // chunk == pos[batch_idx, kv_idx] // chunk
                return same_doc(batch_idx, head_idx, q_idx, kv_idx) & same_chunk

            masks[kind] = masking_utils.create_causal_mask(**kw, and_mask_function=same_doc_and_chunk)
        else:  # recurrent or linear-attention layers carry state across a packed sequence
            raise ValueError(f"cannot keep packed documents apart in {kind!r} layers")
    if additive:
        masks = {kind: _additive(mask, dtype) for kind, mask in masks.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Eager attention's mask (0 where a query attends, the dtype's minimum elsewhere) from the
    boolean one, on the mask's device. transformers' own eager builder makes its 0 a host tensor
    copied to the device, which a CUDA graph being recorded refuses."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _inputs_to(device: torch.device):
    """A forward pre-hook that moves a module's tensor inputs (also inside tuples, lists and dicts,
    as RoPE tables and per-layer-type masks come) to `device`."""

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=True) if x.device != device else x
        if isinstance(x, tuple | list):
            return type(x)(move(v) for v in x)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x

    def hook(_module, args, kwargs):
        return move(args), move(kwargs)

    return hook


class TargetModel:
    def __init__(
        self,
        path: str | Path,
        layer_ids: list[int] | tuple[int, ...],
        device: str | torch.device | list[str],
        dtype: torch.dtype | None = None,
        random_init: bool = False,
        seed: int = 0,
        teacher: bool = False,
        fp8: bool = False,
    ):
        """device: one device, or a list of devices over which the decoder layers are split in
        equal consecutive stages (a target larger than one GPU); the embedding sits on the first,
        the final norm and LM head on the last, and features come out on the first.
        random_init: build the architecture of `path`'s config.json with random weights
        (benchmarks and dry runs of large targets without their weights).
        teacher: capture() runs the whole decoder and appends its final (normed) hidden state to
        the features, for objectives that distil the target's next-token distribution; else the
        forward stops at the deepest captured layer.
        fp8: the decoder's linear layers run as FP8 GEMMs (target_precision.py; CUDA with FP8
        matmuls, which the engine checks at its start)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path = Path(path)
        stages = [torch.device(d) for d in (device if isinstance(device, list) else [device])]
        if not stages:
            raise ValueError("a target needs at least one device")
        self.stages = stages
        self.device = stages[0]
        self.dtype = dtype or compute_dtype(self.device)
        config = AutoConfig.from_pretrained(str(self.path))
        attn = attention_implementation(config)
        # a split target is assembled on the host, then each stage moves to its device
        home = self.device if len(stages) == 1 else torch.device("cpu")
        from .target_precision import (
            check_safetensors_files,
            fp8_checkpoint_blocks,
            load_fp8_checkpoint,
            without_quantization,
        )

        fp8_blocks = fp8_checkpoint_blocks(config)  # a checkpoint stored in fine-grained FP8
        if random_init:
            torch.manual_seed(seed)
            with torch.device(home):
                model = AutoModelForCausalLM.from_config(
                    without_quantization(config), dtype=self.dtype, attn_implementation=attn
                )
            fp8_blocks = None  # random weights: nothing stored to run as stored
        elif fp8_blocks is not None:
            with torch.device(home):
                model = load_fp8_checkpoint(self.path, config, self.dtype, attn, fp8_blocks)
        else:
            # the loader's own error would not name the file; a quantized checkpoint's integer
            # weights are its quantization's to read
            check_safetensors_files(self.path, float_weights=getattr(config, "quantization_config", None) is None)
            model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=self.dtype, attn_implementation=attn)
        model.requires_grad_(False).eval().to(home)
        self.model = model
        self.config = model.config
        self.layer_ids = list(layer_ids)
        self.teacher = teacher
        decoder_layers = self.decoder_layers()
        bad = [i for i in self.layer_ids if not 0 <= i < len(decoder_layers)]
        if bad:
            raise ValueError(f"target has {len(decoder_layers)} layers; cannot capture {bad}")
        if len(stages) > 1:
            self._place_stages(decoder_layers)
        self.stored_fp8 = fp8_blocks is not None
        self._input_casts: Any = None  # the FP8 linears' shared activation casts, cleared per forward
        if fp8 and not self.stored_fp8:  # an FP8 checkpoint already runs as it is served
            from .target_precision import quantize_decoder_linears

            self._input_casts = quantize_decoder_linears(decoder_layers)
            if self._input_casts is None:
                raise ValueError(
                    'target_precision = "fp8": the target\'s decoder layers have no linear layer FP8 takes'
                )
        # the norms', the rotary embedding's and the q/k/v projections' dispatchers go in before
        # anything compiles the layers (record_graph's fusion), so every trace sees them; only the
        # regeneration decoder turns them on (target_norms.py, target_rope.py, target_qkv.py)
        NormKernels.of(self.model)
        install_rope_dispatch(self.model)
        QkvDispatch.of(self.model)
        self._local = threading.local()
        self._embedding_scale: float | None = None
        self._graph: Any = None  # record_graph(): the capture at the production length as a CUDA graph
        self._graph_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._graph_output: torch.Tensor | None = None
        self._fusion: LayerFusion | None = None  # record_graph(fuse=True): compiled layers at the recorded length
        self._fused_len = -1
        last = max(self.layer_ids)
        for i in sorted(set(self.layer_ids)):
            decoder_layers[i].register_forward_hook(self._make_hook(i, stop=(i == last)))

    @property
    def label(self) -> str:
        """The device, or the stages joined by '+' (as metrics and logs name this copy)."""
        return "+".join(str(d) for d in self.stages)

    def _place_stages(self, layers: nn.ModuleList) -> None:
        """Layer i goes to stage i * S // L; everything before the layers (embedding, RoPE) to the
        first stage, the final norm and LM head to the last. A pre-hook on every module that runs
        on another device than its input brings the input over (hidden states, RoPE tables,
        masks), as a pipeline stage boundary does."""
        first, last = self.stages[0], self.stages[-1]
        self.model.to(first)
        n = len(layers)
        for i, layer in enumerate(layers):
            stage = self.stages[i * len(self.stages) // n]
            layer.to(stage)
            layer.register_forward_pre_hook(_inputs_to(stage), with_kwargs=True)
        for module in (getattr(self.decoder(), "norm", None), self.model.get_output_embeddings()):
            if module is not None:
                module.to(last)
                module.register_forward_pre_hook(_inputs_to(last), with_kwargs=True)

    def decoder(self) -> nn.Module:
        """The decoder stack (embeddings, layers, masks, RoPE) without the LM head."""
        decoder = self.model.get_decoder()
        if not hasattr(decoder, "layers") and hasattr(getattr(self.model, "model", None), "layers"):
            # get_decoder follows base_model_prefix, which some causal LMs name after another
            # attribute than the one holding their decoder (Llama 4's text model)
            decoder = self.model.model
        return decoder

    def decoder_layers(self) -> nn.ModuleList:
        layers = getattr(self.decoder(), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"{type(self.model).__name__}: no decoder layers at model.get_decoder().layers")
        return layers

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

    @property
    def embedding_scale(self) -> float:
        """The constant the target's embedding module multiplies its table by (Gemma 3:
        sqrt(hidden_size) in the model's dtype; 1.0 for most families), read from the module and
        checked against its output (parity.input_embedding_scale; raises TargetRefused)."""
        if self._embedding_scale is None:
            self._embedding_scale = input_embedding_scale(self.model)
        return self._embedding_scale

    def frozen_head(self) -> FrozenHead:
        """The drafter's embedding table is the target's with its embedding scale folded in, so
        a block's embedding is one lookup that equals the target's embedding module's output (and
        the reference loop's input); the LM head is the target's as it is."""
        embed = scaled_table(self.model.get_input_embeddings().weight, self.embedding_scale)
        return FrozenHead(embed, self.model.get_output_embeddings().weight)

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """Features [S, n*H] of one packed sequence: concatenated outputs of the captured layers
        (a teacher target: [S, (n+1)*H], its final hidden states last).
        At the recorded length (record_graph) the result is the graph's output buffer, which the
        next capture overwrites: the caller copies it out (in stream order) before capturing again."""
        if (
            self._graph is not None
            and self._graph_inputs is not None
            and input_ids.shape == self._graph_inputs[0].shape
        ):
            for static, given in zip(self._graph_inputs, (input_ids, position_ids, doc_ids), strict=True):
                static.copy_(given, non_blocking=True)
            self._graph.replay()
            assert self._graph_output is not None
            return self._graph_output
        return self._capture(input_ids, position_ids, doc_ids)

    def layer_fusion(self, packed_attention: bool) -> LayerFusion:
        """The compiled decoder layers of record_graph. Their forwards build the packed attention's
        BlockMasks only where packed_attention is on and the layers' attention is transformers'
        SDPA, which the packed path stands in front of: a target on eager attention (gpt-oss, for
        its sinks) would build them for nothing."""
        sdpa = getattr(self.config, "_attn_implementation", None) == "sdpa"
        return LayerFusion(self.decoder_layers(), packed=packed_attention and sdpa)

    @torch.no_grad()
    def record_graph(self, seq_len: int, fuse: bool = True, packed_attention: bool = True) -> bool:
        """Record capture() of a sequence of seq_len tokens as a CUDA graph, so that a micro-batch
        costs the host one replay instead of the eager forward's hundreds of kernel launches (and
        the feature pipeline's thread holds the GIL that much less). fuse: the graph records the
        compiled decoder layers (target_fusion.py; compiled here, on the first warm-up forward). A
        target on one CUDA device only (a split target moves tensors between devices inside its
        forward). Call it from the thread that warms the engine, before any worker thread exists:
        recording captures every kernel launched on the device's capturing stream. False where
        nothing was recorded."""
        if len(self.stages) != 1 or self.device.type != "cuda":
            return False
        if fuse:
            use_packed_attention(packed_attention)
            self._fusion = self.layer_fusion(packed_attention)
            self._fused_len = seq_len
        dev = self.device
        inputs = (
            torch.zeros(seq_len, dtype=torch.long, device=dev),
            torch.arange(seq_len, dtype=torch.long, device=dev),
            torch.zeros(seq_len, dtype=torch.long, device=dev),
        )
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # lazy initialisations (cuBLAS handles, workspaces) happen outside the graph
            for _ in range(2):
                self._capture(*inputs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # the device's own capture stream, and the device current (as step_graph.StepGraph)
        with torch.cuda.device(dev), torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):
            output = self._capture(*inputs)
        torch.cuda.synchronize(dev)
        self._graph, self._graph_inputs, self._graph_output = graph, inputs, output
        return True

    @property
    def fused_tolerance(self) -> float:
        """How far a fused layer may be off the eager one (target_fusion.fused_tolerance)."""
        return fused_tolerance(self.stored_fp8 or self._input_casts is not None)

    @property
    def fused(self) -> bool:
        """Whether the recorded graph runs the compiled decoder layers."""
        return self._fusion is not None

    def drop_graph(self) -> None:
        """Back to eager captures: no graph, and the layers' own forward."""
        self._graph = self._graph_inputs = self._graph_output = None
        if self._fusion is not None:
            self._fusion.remove()
        self._fusion, self._fused_len = None, -1

    def fused_layer_error(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> float:
        """How far the fused layers are off the eager ones, layer by layer (LayerFusion.layer_error),
        on the inputs of a capture of this sequence."""
        if self._fusion is None:
            return 0.0
        try:
            return self._fusion.layer_error(lambda: self._capture(input_ids, position_ids, doc_ids))
        finally:
            self._release_casts()

    @torch.no_grad()
    def capture_ungraphed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor
    ) -> torch.Tensor:
        """capture() without replaying the graph: the code the graph recorded (fused layers where
        it fused them), run as it is; warm-up checks the replay against it."""
        return self._capture(input_ids, position_ids, doc_ids)

    def _capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        mask = packed_masks(self.config, doc_ids, position_ids, self.dtype)
        self._local.captured = {}
        self._local.early_stop = not self.teacher
        final: list[torch.Tensor] = []
        fused = self._fusion is not None and input_ids.shape[0] == self._fused_len
        try:
            with self._fusion.active() if fused and self._fusion else contextlib.nullcontext():
                out = self.decoder()(
                    input_ids=input_ids.unsqueeze(0),
                    position_ids=position_ids.unsqueeze(0),
                    attention_mask=mask,
                    use_cache=False,
                )
            if self.teacher:
                final.append(out.last_hidden_state[0].to(self.device))
        except _StopForward:
            pass
        finally:
            captured, self._local.captured = self._local.captured, None
            self._release_casts()
        return torch.cat([captured[i][0].to(self.device) for i in self.layer_ids] + final, dim=-1)

    def _release_casts(self) -> None:
        if self._input_casts is not None:
            self._input_casts.clear()

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain causal forward of one sequence [T]: (logits [T, V], features [T, n*H])."""
        self._local.captured = {}
        self._local.early_stop = False
        try:
            out = self.model(input_ids=input_ids.unsqueeze(0), use_cache=False)
        finally:
            captured, self._local.captured = self._local.captured, None
            self._release_casts()
        features = torch.cat([captured[i][0].to(self.device) for i in self.layer_ids], dim=-1)
        return out.logits[0].to(self.device), features
