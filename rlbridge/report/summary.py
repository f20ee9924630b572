"""report.md: what a person wants at a glance: which run, how far, did it learn, where the time went."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from rlbridge.algo.drift import first_growth, measures_agreement
from rlbridge.metrics.evals import eval_columns
from rlbridge.report.plots import PLOTS, phase_keys
from rlbridge.report.run import RunData

TRAIN_METRICS = (
    ("reward_mean", "reward (mean)", ".3f"),
    ("accuracy", "train accuracy (sampled)", ".1%"),
    ("kl", "KL", ".4f"),
    ("entropy", "entropy", ".3f"),
    ("grad_norm", "grad norm", ".3f"),
    ("logprob_diff_mean", "trainer vs rollout log-prob, mean abs diff", ".2e"),
    ("rc_weight_mean", "importance weight trainer / rollout, mean", ".4f"),
    ("rc_ess", "importance weights, effective sample size", ".3f"),
    ("rc_masked_token_frac", "tokens masked by rollout correction", ".1%"),
    ("response_length", "response length (tokens)", ".1f"),
    ("tokens_per_s", "response tokens / s", ".1f"),
)


def _num(v: Any, spec: str) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    return f"{v}" if not math.isfinite(v) else format(v, spec)


def _values(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (int(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float))
        and not isinstance(r.get(key), bool)
        and math.isfinite(float(r[key]))
    ]


def _overview(run: RunData) -> list[str]:
    lora = run.get("lora.rank", 0)
    trainer = f"{run.get('trainer.engine', '?')}, " + (
        f"LoRA rank {lora} ({', '.join(run.get('lora.targets', []) or [])}, {run.get('lora.type', 'lora')})"
        if lora
        else "full fine-tuning"
    )
    kl = run.get("algorithm.kl.coef")
    rows = [
        ("status", f"**{run.status.state}**: {run.status.detail}"),
        (
            "steps",
            f"{run.steps_done} done of {run.steps_planned if run.steps_planned is not None else '?'} planned",
        ),
        ("model", f"`{run.get('model.path', '?')}` ({run.get('model.dtype', '?')})"),
        (
            "algorithm",
            f"{run.get('algorithm.name', '?')}"
            + (
                f", KL coef {kl} ({run.get('algorithm.kl.estimator')}, in the {run.get('algorithm.kl.where')})"
                if kl
                else ", no KL term"
            ),
        ),
        ("trainer", trainer),
        (
            "rollout",
            f"{run.get('rollout.engine', '?')}, n {run.get('rollout.n', '?')}, weight sync {run.get('rollout.weight_sync', '?')}",
        ),
        (
            "batch",
            f"{run.get('data.batch_size', '?')} prompts/step, learning rate {run.get('trainer.optim.lr', '?')}",
        ),
        (
            "cluster",
            f"{run.get('cluster.nodes', '?')} node(s) x {run.get('cluster.gpus_per_node', '?')} {run.get('cluster.device', '?')} device(s)",
        ),
        ("checkpoints", ", ".join(f"step {s}" for s in run.checkpoints[-5:]) if run.checkpoints else "none"),
        ("run directory", f"`{run.run_dir}`"),
    ]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if run.bad_lines:
        lines += [
            "",
            f"{run.bad_lines} unreadable line(s) of metrics.jsonl skipped (a write in progress, or a writer that was killed).",
        ]
    return lines


def _evaluation(run: RunData) -> list[str]:
    if not run.evals:
        return ["No evaluation logged (no `data.val`, or the run stopped before the first one)."]
    samples = run.evals[-1].get("eval_samples")
    head = (
        f"The recipe's eval.metrics on {int(samples)} held-out prompts."
        if isinstance(samples, (int, float))
        else ""
    )
    lines = [head, "", "| metric | first | last | best | change |", "|---|---|---|---|---|"]
    for key, label, is_rate in eval_columns(run.recipe, run.evals):
        vals = _values(run.evals, key)
        if not vals:
            continue
        spec = ".1%" if is_rate else ".3f"
        (s0, v0), (s1, v1) = vals[0], vals[-1]
        sb, vb = max(vals, key=lambda sv: sv[1])
        change = f"{(v1 - v0) * 100:+.1f} pts" if spec == ".1%" else f"{v1 - v0:+.3f}"
        lines.append(
            f"| {label} | {format(v0, spec)} (step {s0}) | {format(v1, spec)} (step {s1}) | {format(vb, spec)} (step {sb}) | {change} |"
        )
    return lines


def _training(run: RunData) -> list[str]:
    if not run.train:
        return ["No training step logged yet."]
    window = min(10, len(run.train))
    lines = [
        f"| metric | first (step {run.train[0]['step']}) | last (step {run.train[-1]['step']}) | mean of last {window} |",
        "|---|---|---|---|",
    ]
    for key, label, spec in TRAIN_METRICS:
        vals = [v for _, v in _values(run.train, key)]
        if not vals:
            continue
        recent = [v for _, v in _values(run.train[-window:], key)]
        lines.append(
            f"| {label} | {_num(vals[0], spec)} | {_num(vals[-1], spec)} | {_num(sum(recent) / len(recent), spec) if recent else '-'} |"
        )
    skipped = sum(1 for r in run.train if r.get("skipped"))
    errors = sum(float(r.get("reward_error") or 0) for r in run.train)
    notes = []
    if skipped:
        notes.append(f"{skipped} step(s) skipped for non-finite loss or gradients")
    if errors:
        notes.append(f"{errors:.0f} reward function error(s)")
    drift = _drift(run)
    if drift:
        notes.append(drift)
    return lines + ([""] + ["; ".join(notes) + "."] if notes else [])


def _drift(run: RunData) -> str | None:
    """run.health.max_logprob_diff_growth replayed over the records (algo/drift.py): where the trainer-vs-rollout
    log-prob gap first grew past it, as the loop warned (or stopped) then."""
    growth = run.get("run.health.max_logprob_diff_growth", 2.0)
    batch = run.get("data.batch_size", 1)
    mini = run.get("data.mini_batch_size") or batch
    watched = measures_agreement(
        bypass=bool(run.get("algorithm.rollout_correction.bypass", False)),
        ppo_epochs=int(run.get("trainer.ppo_epochs", 1)),
        mini_batches=2 if isinstance(mini, int) and isinstance(batch, int) and mini < batch else 1,
    )
    found = first_growth(run.train, growth if isinstance(growth, (int, float)) else None) if watched else None
    return None if found is None else f"**step {found[0]}: {found[1]}** (run.health.max_logprob_diff_growth)"


def _timing(run: RunData) -> list[str]:
    keys = phase_keys(run)
    if not keys:
        return ["No step timed yet."]
    n = len(run.train)
    means = {k: sum(float(r.get(k) or 0.0) for r in run.train) / n for k in keys}
    total = sum(means.values()) or 1e-9
    lines = [f"Mean over {n} step(s), seconds.", "", "| phase | mean s | share |", "|---|---|---|"]
    lines += [
        f"| {k.removeprefix('time_')} | {v:.2f} | {v / total:.0%} |"
        for k, v in sorted(means.items(), key=lambda kv: -kv[1])
    ]
    lines.append(f"| **step** | **{total:.2f}** | |")
    evals = _values(run.evals, "time_eval")
    if evals:
        lines += [
            "",
            f"An evaluation took {sum(v for _, v in evals) / len(evals):.1f} s on average ({len(evals)} evaluations).",
        ]
    return lines


def summary(run: RunData, plots: list[str], out_dir: Path) -> str:
    name = run.get("name", run.run_dir.name)
    made = time.strftime("%Y-%m-%d %H:%M")
    parts = [
        f"# Run report: {name}",
        "",
        f"Made by `rlbridge report` on {made}.",
        "",
        *_overview(run),
        "",
        "## Evaluation",
        "",
        *_evaluation(run),
        "",
        "## Training",
        "",
        *_training(run),
        "",
        "## Time per step",
        "",
        *_timing(run),
        "",
        "## Plots",
        "",
    ]
    for p in plots:
        title = PLOTS.get(p, p)
        parts += [f"### {title[0].upper() + title[1:]}", "", f"![{title}]({p})", ""]
    return "\n".join(parts)
