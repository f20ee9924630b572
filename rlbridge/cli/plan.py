"""`rlbridge plan`: the execution plan (placement, rank layout, batch arithmetic, memory per device)."""

from __future__ import annotations

import json
from pathlib import Path

from rlbridge.cli import render
from rlbridge.cli.common import ForceOpt, JsonOpt, NoModelOpt, RecipeArg, SetOpt, example, user_errors
from rlbridge.plan import make_plan
from rlbridge.recipe import validate_recipe


@example("rlbridge plan recipes/qwen2.5-7b-grpo-lora.yaml --json")
def plan(
    recipe: Path = RecipeArg,
    set_: list[str] = SetOpt,
    as_json: bool = JsonOpt,
    no_model_checks: bool = NoModelOpt,
    force: bool = ForceOpt,
) -> None:
    """Print the execution plan of a (valid) recipe. Pure arithmetic: no GPU, under a second."""
    with user_errors(as_json):
        valid = validate_recipe(recipe, set_, model_checks=not no_model_checks, force=force)
    p = make_plan(valid.recipe, valid.model)
    if as_json:
        print(json.dumps(p.to_dict(), indent=2))
    else:
        render.plan_full(p)
