"""Printing for the commands: issues, the plan. No logic beyond formatting."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from rlbridge.errors import RecipeIssue
from rlbridge.plan import Plan

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def issues_table(issues: list[RecipeIssue], title: str) -> None:
    """One block per issue: the key on its own line (never wrapped), then the problem and the fix."""
    err.print(f"[bold red]{title}[/]")
    for i in issues:
        err.print(f"  [bold]{i.key}[/]" + (f"  [dim]{i.where}[/]" if i.where else ""), soft_wrap=True)
        problem = i.message + (f" (got {i.value})" if i.value is not None else "")
        err.print(f"      {problem}", soft_wrap=True)
        if i.fix:
            err.print(f"      [green]fix:[/] {i.fix}", soft_wrap=True)


def issues_json(issues: list[RecipeIssue]) -> None:
    print(json.dumps({"valid": False, "errors": [i.to_dict() for i in issues]}, indent=2))


def _gib(x: float) -> str:
    return f"{x:.2f}"


def plan_summary(p: Plan) -> None:
    b = p.batches
    out.print(
        f"[bold]layout[/] {p.world_size} {'GPU' if p.device == 'cuda' else 'CPU worker'}(s): "
        f"dp {p.dp} x tp {p.tp} x pp {p.pp} x cp {p.cp} (ep {p.ep}, etp {p.etp}, vpp {p.vpp}); "
        f"rollout: {p.rollout_engines} engine(s) x tp {p.rollout_tp}, {'colocated' if p.colocate else 'separate'}"
    )
    out.print(
        f"[bold]batch[/] {b.prompts_per_step} prompts -> {b.rollouts_per_step} rollouts/step; "
        f"{b.mini_batches_per_step} mini-batch(es), {b.optimizer_steps_per_step} optimizer step(s)/step; "
        f"{b.sequences_per_dp_rank} seqs per dp rank per mini-batch = "
        + (
            f"{b.micro_batches_per_mini_batch} micro-batch(es)"
            if b.tokens_per_micro_batch is None
            else f"passes of <= {b.tokens_per_micro_batch} tokens (as many as the lengths need)"
        )
    )
    if p.memory is not None:
        m = p.memory
        out.print(
            f"[bold]memory[/] per {'device' if p.device == 'cuda' else 'worker (host RAM)'} ~{_gib(m.peak)} GiB peak"
            + (f" of {m.capacity:.0f}" if p.device == "cuda" else "")
            + " "
            f"(trainer {_gib(m.trainer_total)}, rollout {_gib(m.rollout_total)}"
            + (f", reward model {_gib(m.reward_model_total)} on GPU 0" if m.reward_model_total else "")
            + "); trainable "
            f"{m.trainable_params:,} of {m.total_params:,} params"
        )
    for note in p.notes:
        out.print(f"[yellow]note[/] {note}")


def plan_full(p: Plan) -> None:
    plan_summary(p)
    if p.memory is not None:
        m = p.memory
        t = Table(title="memory per device (GiB, estimate)", title_justify="left")
        for col in ("phase", "weights", "grads", "optimizer", "activations", "KV cache", "total"):
            t.add_column(col, justify="right")
        t.add_row(
            "train",
            _gib(m.weights),
            _gib(m.gradients),
            _gib(m.optimizer),
            _gib(m.activations),
            "-",
            _gib(m.trainer_total),
        )
        if m.critic:
            t.add_row("  incl. PPO critic", "", "", "", "", "-", _gib(m.critic))
        t.add_row(
            "rollout", _gib(m.rollout_weights), "-", "-", "-", _gib(m.rollout_kv_cache), _gib(m.rollout_total)
        )
        if m.reward_model_total:  # GPU 0 of node 0 only, in the peak; its CUDA context is in the total
            t.add_row(
                "reward model (GPU 0)",
                _gib(m.reward_model_weights),
                "-",
                "-",
                _gib(m.reward_model_activations),
                "-",
                _gib(m.reward_model_total),
            )
        if m.trainable_params < m.total_params:
            t.add_row("train, full FT", "", "", "", "", "-", _gib(m.full_ft_trainer_total))
        out.print(t)
    t = Table(title="trainer ranks", title_justify="left")
    for col in ("rank", "node", "local", "dp", "tp", "pp", "cp", "ep", "etp"):
        t.add_column(col, justify="right")
    shown = p.trainer_ranks[:64]
    for c in shown:
        t.add_row(*(str(v) for v in (c.rank, c.node, c.local, c.dp, c.tp, c.pp, c.cp, c.ep, c.etp)))
    out.print(t)
    if len(p.trainer_ranks) > len(shown):
        out.print(f"... {len(p.trainer_ranks) - len(shown)} more ranks (see --json)")
    out.print(
        f"[bold]rollout engines[/] {'; '.join(p.engine_places()[:16])}"
        + (" ..." if p.rollout_engines > 16 else "")
    )
    bundles = ", ".join(f"node {i}: {len(b)} x {b[0] if b else {}}" for i, b in enumerate(p.bundles_per_node))
    out.print(
        f"[bold]Ray bundles[/] {bundles}"
        + (f"; rollout: {len(p.rollout_bundles)} separate" if p.rollout_bundles else "")
    )


def print_summary(s: Any) -> None:
    """s: rlbridge.loop.Summary (not imported here: the loop pulls in torch)."""
    out.print(f"[bold green]done[/] {s.steps} steps in {s.seconds / 60:.1f} min; run directory {s.run_dir}")
    if s.before and s.after:
        from rlbridge.metrics.evals import eval_columns

        t = Table(title="held-out evaluation (eval.metrics)", title_justify="left")
        for col in ("", "step 0", f"step {s.steps}", "change"):
            t.add_column(col, justify="right")
        for c in eval_columns(s.recipe, [s.before, s.after]):
            b, a = s.before.get(c.key, 0.0), s.after.get(c.key, 0.0)
            change = f"{(a - b) * 100:+.1f} pts" if c.is_rate else f"{a - b:+.3f}"
            t.add_row(c.label, c.show(b), c.show(a), change)
        out.print(t)
