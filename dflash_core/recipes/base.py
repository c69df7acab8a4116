"""What a drafter recipe is, as plain values (no torch: the daemon validates its configuration
and the service its jobs before torch is imported): the block layout it drafts in, its block
size, position weights and default loss, whether it has heads beyond the DFlash backbone, and
the module that holds its torch hooks (`ops`: drafting, heads, the loss rows, export fields).

The code asks a recipe's spec, never its name (as torchtitan's TrainSpec is looked up once at
build). A new recipe is one spec module, one ops module and one line in the table
(`recipes/__init__.py`)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Which token each slot of a block predicts. The block's input is always the anchor token
    then mask tokens, at positions a .. a + B - 1.

    fill_in (DFlash: z-lab, SpecForge): slot 0 holds the anchor and predicts nothing; slot
    k = 1..B-1 predicts token a + k; a block drafts B - 1 tokens.
    anchor_first (DSpark as DeepSpec, speculators, vLLM and SGLang serve it; DeepSpec's DFlash
    baseline too): slot k = 0..B-1 predicts token a + k + 1; a block drafts B tokens. DeepSpec
    supervises only the contiguous prefix of a block whose labels are loss-masked tokens
    (`build_eval_mask`'s cumprod), so this layout does too."""

    name: str
    first_slot: int  # the first slot that predicts a token
    prefix_mask: bool  # supervise only up to the first unsupervised label of a block

    @property
    def sample_from_anchor(self) -> bool:
        """speculators' name for the layout: the anchor's own slot drafts the first token."""
        return self.first_slot == 0

    def drafted(self, block_size: int) -> int:
        """Tokens one block drafts."""
        return block_size - self.first_slot

    def label_offset(self, slot: int) -> int:
        """Slot `slot` predicts token anchor + label_offset(slot)."""
        return slot + 1 - self.first_slot


FILL_IN = Layout("fill_in", first_slot=1, prefix_mask=False)
ANCHOR_FIRST = Layout("anchor_first", first_slot=0, prefix_mask=True)
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (FILL_IN, ANCHOR_FIRST)}


def layout_named(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


def layout_of_config(d: Mapping[str, Any]) -> Layout:
    """The layout a checkpoint's config.json states. A config without the field was written
    before the layout was stated, when every checkpoint of ours was fill_in: read as written."""
    value = d.get("sample_from_anchor")
    if value is None:
        value = (d.get("dflash_config") or {}).get("sample_from_anchor")
    if value is None:
        return FILL_IN
    if not isinstance(value, bool):
        raise ValueError(f"sample_from_anchor must be true or false, got {value!r}")
    return ANCHOR_FIRST if value else FILL_IN


@dataclass(frozen=True)
class Recipe:
    name: str
    layout: Layout  # the default; an engine may train another (`[engine] layout`)
    block_size: int | None  # the block size the recipe drafts in; None: the engine's setting
    # the decay constant of the position weights exp(-(k - first_slot) / gamma); None: the
    # DFlash rule for the block size (config.default_loss_gamma)
    gamma: float | None
    loss: Mapping[str, float] | None  # the default loss mix (objective_spec.parse_loss); None: ce
    teacher: bool  # its default loss reads the target's distribution
    heads: bool  # Markov and confidence heads beyond the DFlash backbone
    architecture: str  # config.json's class, in the shipped modeling file
    ops: str  # the module of its torch hooks, imported on first use
    # settings of the engine that only this recipe takes
    settings: tuple[str, ...] = field(default=())
    # dflash_config.projector_type of its checkpoints (what configs written before they named the
    # class by architecture say); None: none
    projector: str | None = None

    def hooks(self) -> Any:
        """The recipe's torch hooks (its ops module's OPS)."""
        return importlib.import_module(self.ops).OPS


class RecipeTable:
    """The recipes the daemon knows, by name; a name registered twice is refused."""

    def __init__(self, *recipes: Recipe):
        self._by_name: dict[str, Recipe] = {}
        for recipe in recipes:
            self.register(recipe)

    def register(self, recipe: Recipe) -> None:
        if recipe.name in self._by_name:
            raise ValueError(f"recipe {recipe.name!r} is registered twice")
        self._by_name[recipe.name] = recipe

    def __getitem__(self, name: str) -> Recipe:
        if name not in self._by_name:
            raise ValueError(f"recipe must be one of {', '.join(self._by_name)}, got {name!r}")
        return self._by_name[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def of_config(self, d: Mapping[str, Any]) -> Recipe:
        """The recipe a checkpoint's config.json describes: by its class where it names one of
        ours, else by dflash_config.projector_type, else the first recipe (DFlash)."""
        archs = d.get("architectures")
        for arch in archs if isinstance(archs, list) else []:
            for recipe in self._by_name.values():
                if recipe.architecture == arch:
                    return recipe
        projector = (d.get("dflash_config") or {}).get("projector_type")
        by_projector = [r for r in self._by_name.values() if projector is not None and r.projector == projector]
        return by_projector[0] if by_projector else next(iter(self._by_name.values()))
