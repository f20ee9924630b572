"""`rlbridge report`: plots and a markdown summary of a run directory (finished, running, stopped or crashed)."""

from __future__ import annotations

from pathlib import Path

import typer

from rlbridge.cli import render
from rlbridge.cli.common import example, user_errors

RunDirArg = typer.Argument(
    ..., help="Run directory (the one `rlbridge train` printed).", exists=True, file_okay=False
)
OutOpt = typer.Option(None, "--out", help="Output directory (default: RUN_DIR/report).")


@example("rlbridge report runs/quickstart-20261130-1200 --out report/")
def report(run_dir: Path = RunDirArg, out: Path | None = OutOpt) -> None:
    """Write report.md and PNG plots (reward and accuracy, KL, entropy, grad norm, time per phase, tokens/s).
    Reads only files, so it works on a run that is still going or one that crashed. Exit 0 written, 1 not a run."""
    with user_errors():
        from rlbridge.report import render_report

        rep = render_report(run_dir, out)
    st = rep.run.status
    render.out.print(f"[bold]{rep.run.get('name', run_dir.name)}[/] {st.state}: {st.detail}")
    render.out.print(f"report: {rep.markdown}  ({len(rep.plots)} plots beside it)")
