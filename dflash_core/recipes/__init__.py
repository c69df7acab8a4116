"""The drafter recipes, one table: DFlash (block CE, fill-in blocks) and DSpark (the DFlash
backbone with Markov and confidence heads, anchor-first blocks). Each is a spec (base.Recipe,
plain values) and an ops module of torch hooks; the code looks a recipe up here by its name once
and asks the spec from then on. A new recipe: its two modules and one line below."""

from __future__ import annotations

from .base import ANCHOR_FIRST, FILL_IN, LAYOUTS, Layout, Recipe, RecipeTable, layout_named, layout_of_config
from .dflash_settings import DFLASH
from .dspark_settings import DSPARK

RECIPES = RecipeTable(DFLASH, DSPARK)


def recipe_named(name: str) -> Recipe:
    return RECIPES[name]


__all__ = [
    "ANCHOR_FIRST",
    "FILL_IN",
    "LAYOUTS",
    "RECIPES",
    "Layout",
    "Recipe",
    "layout_named",
    "layout_of_config",
    "recipe_named",
]
