"""`rlbridge export-hf`: a Hugging Face directory from a run or checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer

from rlbridge.cli import render
from rlbridge.cli.common import example


@example("rlbridge export-hf runs/quickstart-20261130-1200 --out exported/ --merge-lora")
def export_hf(
    source: Path = typer.Argument(..., help="Run directory or checkpoint directory."),
    out: Path = typer.Option(..., "--out", help="Output directory."),
    merge_lora: bool = typer.Option(True, "--merge-lora/--adapter-only", help="Merged full model, or a PEFT adapter."),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step (default: newest complete)."),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty --out."),
) -> None:
    """Write a Hugging Face checkpoint that transformers, vLLM and peft load."""
    render.err.print("[red]error:[/] export-hf is not available yet (see the checkpoint issue)")
    raise typer.Exit(1)
