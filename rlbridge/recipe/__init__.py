"""Recipe: schema (typed, frozen), loading (YAML + overrides), checks (model- and cluster-aware).

`validate_recipe` is the one entry point the commands use: it returns a typed Recipe or raises
RecipeError with every problem found.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlbridge.errors import RecipeError, RecipeIssue
from rlbridge.model.info import ModelInfo
from rlbridge.recipe.checks import run_checks
from rlbridge.recipe.load import Source, build_recipe, load_recipe, load_recipe_data
from rlbridge.recipe.schema import Recipe


@dataclass(frozen=True)
class ValidRecipe:
    recipe: Recipe
    model: ModelInfo | None
    """Read from the model's config.json (None with --no-model-checks)."""


def validate_recipe(
    path: str | Path, overrides: Sequence[str] = (), *, model_checks: bool = True, force: bool = False
) -> ValidRecipe:
    """The recipe at `path` with `overrides`, schema and every check; force: accept an estimated memory peak
    over the device (`--force`)."""
    data, source = load_recipe_data(path, overrides)
    try:
        recipe = build_recipe(data, source)
    except RecipeError as e:
        raise RecipeError(
            e.issues + _checks_despite_schema_errors(data, source, e.issues, model_checks, force)
        ) from None
    issues, info = run_checks(recipe, model_checks=model_checks, force=force)
    if issues:
        raise RecipeError([_located(i, source) for i in issues])
    return ValidRecipe(recipe, info)


def _checks_despite_schema_errors(
    data: dict[str, Any], source: Source, schema_issues: list[RecipeIssue], model_checks: bool, force: bool
) -> list[RecipeIssue]:
    """Report the cross-field problems too: drop the keys the schema rejected (defaults take their place; a
    rejected list item drops its whole list, e.g. trainer.optim.betas.1), run the checks, and keep only issues
    about keys that were not dropped."""
    pruned = copy.deepcopy(data)
    dropped = [i.key for i in schema_issues]
    for key in dropped:
        node: Any = pruned
        parts = key.split(".")
        for i, part in enumerate(parts):
            child = node.get(part) if isinstance(node, dict) else None
            if i == len(parts) - 1 or not isinstance(child, dict):
                if isinstance(node, dict):
                    node.pop(part, None)
                break
            node = child
    try:
        recipe = build_recipe(pruned, source)
    except RecipeError:
        return []
    issues, _ = run_checks(recipe, model_checks=model_checks, force=force)
    related = lambda k: any(k == d or k.startswith(d + ".") or d.startswith(k + ".") for d in dropped)  # noqa: E731
    return [_located(i, source) for i in issues if not related(i.key)]


def _located(issue: RecipeIssue, source: Source) -> RecipeIssue:
    """The issue with its `where`: the `--set` or file line of its key; when the key is the file's (or a default)
    and a `--set` changed one of the issue's origin keys (`--set data.train.split=test` to rows without the prompt
    column), the last such `--set`; when the key is a default and the file writes an origin key, that key's line
    (`split: test`, not the `data:` section)."""
    if issue.where:
        return issue
    where = source.where(issue.key)
    if issue.origin and not where.startswith("--set "):
        written = issue.key in source.lines
        where = (
            source.override_in(*issue.origin) or (None if written else source.line_of(*issue.origin)) or where
        )
    return replace(issue, where=where)


__all__ = ["Recipe", "RecipeError", "ValidRecipe", "load_recipe", "validate_recipe"]
