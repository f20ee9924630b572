"""`rlbridge report`: plots and a markdown summary of a run directory, finished, running, stopped or crashed.

    read_run (run.py)       recipe.yaml, metrics.jsonl, status.json, checkpoints/ -> RunData (files only)
    draw_plots (plots.py)   RunData -> PNGs (matplotlib, Agg; imported only there)
    summary (summary.py)    RunData + plot names -> report.md

Nothing here talks to a live run: a run that is still writing is read as far as its last complete line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlbridge.report.plots import PLOTS, draw_plots
from rlbridge.report.run import RunData, read_run
from rlbridge.report.summary import summary


@dataclass(frozen=True)
class Report:
    markdown: Path
    plots: list[Path]
    run: RunData


def render_report(run_dir: Path, out_dir: Path | None = None) -> Report:
    """Write report.md and one PNG per entry of PLOTS into out_dir (default RUN_DIR/report)."""
    run = read_run(run_dir)
    out = out_dir if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = draw_plots(run, out)
    md = out / "report.md"
    md.write_text(summary(run, [p.name for p in plots], md.parent), encoding="utf-8")
    return Report(md, plots, run)


__all__ = ["PLOTS", "Report", "RunData", "read_run", "render_report"]
