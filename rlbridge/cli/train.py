"""`rlbridge train` and `rlbridge resume`."""

from __future__ import annotations

from pathlib import Path

import typer

from rlbridge.cli import render
from rlbridge.cli.common import RecipeArg, SetOpt, example, user_errors
from rlbridge.recipe import validate_recipe


@example("rlbridge train recipes/quickstart.yaml --set run.steps=20")
def train(
    recipe: Path = RecipeArg,
    set_: list[str] = SetOpt,
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory (default: run.dir or runs/<name>-<time>)."),
) -> None:
    """Validate the recipe, then train. Exit 0 done, 1 failure, 2 invalid recipe."""
    with user_errors():
        valid = validate_recipe(recipe, set_)
    from rlbridge import run_dir as rd
    from rlbridge.plan import make_plan

    plan = make_plan(valid.recipe, valid.model)
    render.plan_summary(plan)
    with user_errors():
        from rlbridge.loop import train as run_training
        from rlbridge.model_cache import ensure_model

        model_dir = ensure_model(valid.recipe.model.path)
        out = rd.create(rd.choose_run_dir(valid.recipe, run_dir), valid.recipe, plan)
        render.out.print(f"run directory: {out}")
        summary = run_training(valid.recipe, plan, out, model_dir)
    render.print_summary(summary)


@example("rlbridge resume runs/quickstart-20261130-1200")
def resume(
    run_dir: Path = typer.Argument(..., help="Run directory to continue."),
    set_: list[str] = SetOpt,
) -> None:
    """Continue a run from its newest complete checkpoint."""
    render.err.print("[red]error:[/] resume is not available yet (see the checkpoint issue)")
    raise typer.Exit(1)
