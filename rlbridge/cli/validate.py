"""`rlbridge validate-recipe`: schema + every check, all problems at once."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rlbridge.cli import render
from rlbridge.cli.common import ForceOpt, JsonOpt, NoModelOpt, RecipeArg, SetOpt, example, user_errors
from rlbridge.plan import make_plan
from rlbridge.recipe import validate_recipe as _validate


@example("rlbridge validate-recipe recipes/quickstart.yaml --set rollout.n=8")
def validate_recipe(
    recipe: Path = RecipeArg,
    set_: list[str] = SetOpt,
    as_json: bool = JsonOpt,
    no_model_checks: bool = NoModelOpt,
    force: bool = ForceOpt,
) -> None:
    """Check a recipe against the schema, the model's config.json and the cluster shape. Exit 0 valid, 2 invalid."""
    with user_errors(as_json):
        valid = _validate(recipe, set_, model_checks=not no_model_checks, force=force)
    plan = make_plan(valid.recipe, valid.model)
    if as_json:
        print(json.dumps({"valid": True, "errors": [], "plan": plan.to_dict()}, indent=2))
        return
    render.out.print(f"[green]valid[/] {recipe} ({valid.recipe.name})")
    render.plan_summary(plan)


validate_recipe.__name__ = "validate_recipe"
_ = typer  # typer reads the annotations above
