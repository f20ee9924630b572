"""The `rlbridge` command: a thin typer app with fixed commands; parsing and printing only.

Exit codes: 0 success, 1 failure at run time, 2 invalid recipe or arguments.
"""

from __future__ import annotations

import sys

import typer

from rlbridge import __version__
from rlbridge.cli import export, plan, recipes, report, schema, train, validate

app = typer.Typer(
    name="rlbridge",
    help="Declarative RL post-training of language models. Start with: rlbridge recipes list",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)
app.command("validate-recipe")(validate.validate_recipe)
app.command("plan")(plan.plan)
app.command("train")(train.train)
app.command("resume")(train.resume)
app.command("export-hf")(export.export_hf)
app.command("schema")(schema.schema)
app.command("report")(report.report)
app.add_typer(recipes.app, name="recipes")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rlbridge {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    pass


def main() -> None:
    try:
        app(prog_name="rlbridge")  # also under `python -m rlbridge`: usage lines and completion say rlbridge
    except KeyboardInterrupt:
        sys.exit(130)
