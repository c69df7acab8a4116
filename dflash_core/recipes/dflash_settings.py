"""The DFlash recipe as plain values: block CE through the frozen LM head, fill-in blocks, the
decay of the DFlash reference for the block size (no torch)."""

from __future__ import annotations

from .base import FILL_IN, Recipe

DFLASH = Recipe(
    name="dflash",
    layout=FILL_IN,
    block_size=None,
    gamma=None,
    loss=None,
    teacher=False,
    heads=False,
    architecture="DFlashDraftModel",
    ops="dflash_core.recipes.dflash",
)
