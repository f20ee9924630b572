"""Recipe: schema (typed, frozen), loading (YAML + overrides), checks (model- and cluster-aware).

`validate_recipe` is the one entry point the commands use: it returns a typed Recipe or raises
RecipeError with every problem found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlbridge.errors import RecipeError
from rlbridge.model_info import ModelInfo
from rlbridge.recipe.checks import run_checks
from rlbridge.recipe.load import build_recipe, load_recipe, load_recipe_data
from rlbridge.recipe.schema import Recipe


@dataclass(frozen=True)
class ValidRecipe:
    recipe: Recipe
    model: ModelInfo | None
    """Read from the model's config.json (None with --no-model-checks)."""


def validate_recipe(path: str | Path, overrides: Sequence[str] = (), *, model_checks: bool = True) -> ValidRecipe:
    data, source = load_recipe_data(path, overrides)
    recipe = build_recipe(data, source)
    issues, info = run_checks(recipe, model_checks=model_checks)
    if issues:
        raise RecipeError([i if i.where else _located(i, source) for i in issues])
    return ValidRecipe(recipe, info)


def _located(issue, source):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(issue, where=source.where(issue.key))


__all__ = ["Recipe", "RecipeError", "ValidRecipe", "load_recipe", "validate_recipe"]
