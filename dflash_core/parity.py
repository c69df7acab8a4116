"""Train/serve parity of the drafter's inputs, decided once per target at warm-up.

At serving time the reference loop (z-lab `dflash_generate`) builds the block's input as
`F.embedding(ids, target.get_input_embeddings().weight) * dflash_config.input_embedding_scale`
(earlier versions called `target.model.embed_tokens(ids)`, the target's own embedding module),
and the context as the concatenated `hidden_states[id + 1]` of the target's forward with
`output_hidden_states=True`. Training must feed the drafter exactly those tensors, or a drafter
converges on inputs it never sees when served (Gemma's embedding module multiplies by
sqrt(hidden_size): about x50 on Gemma-3-4B).

So the scale the target's embedding module applies is read from the model and checked against
the module's own output; it is folded into the frozen embedding table the drafter reads (one
multiplication at warm-up, no extra kernel per step) and written to the checkpoint's
`dflash_config.input_embedding_scale`, which the reference reads back. A target whose inputs
cannot be reproduced this way is refused with the reason."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TargetRefused(ValueError):
    """The target's drafter inputs at serving time cannot be reproduced in training."""


def _declared_scale(module: nn.Module, dtype: torch.dtype) -> float:
    """The scale an embedding module says it applies (`embed_scale`, Gemma 3's buffer), rounded to
    the table's dtype as the module multiplies by it (Gemma3TextScaledWordEmbedding casts the
    scale to the weight's dtype first); 1.0 where it declares none."""
    scale = getattr(module, "embed_scale", None)
    if scale is None:
        return 1.0
    return float(torch.as_tensor(scale).to(dtype))


@torch.no_grad()
def input_embedding_scale(model: nn.Module, probe_tokens: int = 256) -> float:
    """The constant c for which the target's embedding module computes `weight[ids] * c`,
    checked bit for bit on a spread of token ids (the module runs where its weight is)."""
    module: nn.Module = model.get_input_embeddings()  # type: ignore[operator]
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TargetRefused(f"the target's input embedding ({type(module).__name__}) has no [vocab, hidden] weight")
    scale = _declared_scale(module, weight.dtype)
    vocab = weight.shape[0]
    ids = torch.linspace(0, vocab - 1, min(probe_tokens, vocab), device=weight.device).long().view(1, -1)
    got = module(ids)
    lookup = torch.nn.functional.embedding(ids, weight)
    want = lookup if scale == 1.0 else lookup * scale
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        raise TargetRefused(
            f"the target's embedding module {type(module).__name__} does not compute weight[ids] * {scale:g}; "
            "serving feeds the drafter F.embedding(ids, weight) * dflash_config.input_embedding_scale, "
            "so a drafter trained on this module's output would not see the same inputs"
        )
    return scale


def check_serving_parity(config: Any, num_decoder_layers: int, layer_ids: list[int] | tuple[int, ...]) -> None:
    """Refuse what the serving loops compute differently from training, beyond the embedding:

    - the target's last decoder layer: transformers ties `hidden_states[-1]` to the output of the
      final norm, so the reference's feature of layer L-1 is normed where our hook's is not
      (and vLLM / SGLang capture a layer's input, which the last layer's output never is);
    - soft-capped or scaled target logits (Gemma 2, Cohere, Granite): the drafter's loss is a plain
      softmax over `hidden @ lm_head.T`, while the reference samples from the capped logits."""
    last = num_decoder_layers - 1
    if last in layer_ids:
        raise TargetRefused(
            f"target_layer_ids {list(layer_ids)} include the last decoder layer ({last}); the serving loops read "
            f"its hidden state after the final norm (hidden_states[{num_decoder_layers}]); pick layers below {last}"
        )
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None and float(softcap) > 0:
        raise TargetRefused(
            f"the target soft-caps its logits (final_logit_softcapping={softcap}); the drafter's loss does not"
        )
    for name in ("logit_scale", "logits_scaling"):  # Cohere multiplies by it, Granite divides
        value = getattr(config, name, None)
        if value is not None and float(value) != 1.0:
            raise TargetRefused(f"the target scales its logits ({name}={value}); the drafter's loss does not")


def scaled_table(weight: torch.Tensor, scale: float) -> torch.Tensor:
    """The embedding table with the scale folded in, in the weight's dtype (the product rounds
    as the module's does: its scale is already a value of that dtype)."""
    weight = weight.detach()
    return weight if scale == 1.0 else weight * scale
