"""`rlbridge recipes list | show NAME | copy NAME DEST`: start from a shipped recipe."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from rlbridge.cli import render
from rlbridge.cli.common import JsonOpt, example
from rlbridge.recipe import shipped as sh

app = typer.Typer(help="Shipped recipes: list them, print one, copy one to start from.", no_args_is_help=True)


def _complete_names(incomplete: str) -> list[str]:
    """Shell completion of shipped recipe names (`rlbridge recipes show q<TAB>`)."""
    return [r.name for r in sh.shipped() if r.name.startswith(incomplete)]


NameArg = typer.Argument(
    ...,
    help="Recipe name, as `rlbridge recipes list` shows it (e.g. quickstart).",
    show_default=False,
    autocompletion=_complete_names,
)
DestArg = typer.Argument(
    ..., help="File to write, or a directory (the recipe keeps its name there).", show_default=False
)
ForceOpt = typer.Option(False, "--force", help="Overwrite an existing file.")


def _find(name: str) -> sh.Shipped:
    try:
        return sh.find(name)
    except sh.UnknownRecipe as e:
        render.err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None


@app.command("list")
@example("rlbridge recipes list")
def list_recipes(as_json: bool = JsonOpt) -> None:
    """The shipped recipes, each with what it does."""
    recipes = sh.shipped()
    if as_json:
        print(
            json.dumps(
                [{"name": r.name, "description": r.description, "run": r.run} for r in recipes], indent=2
            )
        )
        return
    t = Table(
        title="shipped recipes (rlbridge recipes copy NAME DEST to start from one)", title_justify="left"
    )
    t.add_column("name", no_wrap=True, style="bold")
    t.add_column("what")
    for r in recipes:
        t.add_row(r.name, r.description)
    render.out.print(t)


@app.command("show")
@example("rlbridge recipes show quickstart")
def show(name: str = NameArg) -> None:
    """Print a shipped recipe (YAML with its comments). Exit 2 for an unknown name."""
    print(_find(name).text, end="")


@app.command("copy")
@example("rlbridge recipes copy quickstart my-recipe.yaml")
def copy(name: str = NameArg, dest: Path = DestArg, force: bool = ForceOpt) -> None:
    """Copy a shipped recipe to DEST to edit it. Exit 2 for an unknown name, 1 if DEST exists (see --force)."""
    recipe = _find(name)
    target = dest / f"{recipe.name}.yaml" if dest.is_dir() else dest
    if target.exists() and not force:
        render.err.print(f"[red]error:[/] {target} exists; pass --force to overwrite it")
        raise typer.Exit(1)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(sh.for_copy(recipe, str(target)), encoding="utf-8")
    render.out.print(f"wrote {target}; next: rlbridge validate-recipe {target}")
