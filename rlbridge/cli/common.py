"""Options and error handling shared by the commands."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.markup import escape

from rlbridge.cli import render
from rlbridge.errors import RecipeError, RlbridgeError

RecipeArg = typer.Argument(..., help="Recipe YAML file.", show_default=False)
SetOpt = typer.Option([], "--set", help="Override a key: --set rollout.n=8 (repeatable; YAML scalar values).")
JsonOpt = typer.Option(False, "--json", help="Machine-readable output.")
ForceOpt = typer.Option(
    False,
    "--force",
    help="Accept a recipe whose estimated memory peak exceeds the device (the estimate is within about 30 %): "
    "the error becomes a note of the plan.",
)
NoModelOpt = typer.Option(
    False, "--no-model-checks", help="Skip the checks that read the model's config.json."
)


@contextmanager
def user_errors(as_json: bool = False) -> Iterator[None]:
    """RecipeError -> exit 2 with the issue table; other RlbridgeError -> exit 1 with the message."""
    try:
        yield
    except RecipeError as e:
        if as_json:
            render.issues_json(e.issues)
        else:
            n = len(e.issues)
            render.issues_table(e.issues, f"recipe invalid: {n} problem{'s' if n != 1 else ''}")
        raise typer.Exit(2) from None
    except RlbridgeError as e:
        render.err.print(f"[red]error:[/] {escape(str(e))}")  # messages quote paths like [/a/b.cc:553]
        raise typer.Exit(1) from None


def example(text: str) -> Callable[[Any], Any]:
    """Append a copy-pasteable example to a command's help."""

    def deco(fn: Any) -> Any:
        fn.__doc__ = (fn.__doc__ or "") + f"\n\nExample:\n\n    {text}"
        return fn

    return deco
