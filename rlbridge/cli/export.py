"""`rlbridge export-hf`: a Hugging Face directory from a run or checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer

from rlbridge.cli import render
from rlbridge.cli.common import example, user_errors


@example("rlbridge export-hf runs/quickstart-20261130-1200 --out exported/ --merge-lora")
def export_hf(
    source: Path = typer.Argument(
        ..., help="Run directory (its newest complete checkpoint, or --step) or checkpoint directory."
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output directory (new or empty; --force replaces a previous export)."
    ),
    merge_lora: bool = typer.Option(
        True,
        "--merge-lora/--adapter-only",
        help="Merged full model (default), or a PEFT adapter (LoRA runs).",
    ),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step (default: newest complete)."),
    force: bool = typer.Option(False, "--force", help="Replace the contents of a non-empty --out."),
) -> None:
    """Write a Hugging Face checkpoint that transformers, vLLM and peft load: merged (config, safetensors
    shards, tokenizer, generation config, README with the recipe and step) or adapter-only (adapter_config.json
    + adapter_model.safetensors). Needs neither Ray nor vLLM. Exit 0 written, 1 failure."""
    with user_errors():
        from rlbridge.export import export_hf as run_export

        res = run_export(
            source,
            out,
            merge=merge_lora,
            step=step,
            force=force,
            log=lambda msg: render.out.print(f"[dim]export[/] {msg}", soft_wrap=True),
        )
    render.out.print(
        f"[bold green]exported[/] step {res.step} ({res.kind}) to "
        f"{res.out}: {len(res.files)} files, {res.bytes / 1e6:.1f} MB in {res.seconds:.1f} s",
        soft_wrap=True,
    )
