"""Metrics sinks: metrics.jsonl in the run directory (always) and a one-line-per-step console view.

The jsonl file is the source of truth (one JSON object per step, flushed each step, so a crashed run
keeps every finished step); other loggers (wandb, tensorboard) read the same dicts.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

console = Console(highlight=False, stderr=True)


class Timer:
    """Seconds per phase of one step: `with timer("generate"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    def __init__(self, run_dir: Path, loggers: list[str], total_steps: int) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.console = "console" in loggers
        self.total_steps = total_steps
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=True) + "\n")
        self._file.flush()
        if self.console:
            console.print(_line(record, self.total_steps))

    def close(self) -> None:
        self._file.close()


def _fmt(record: dict[str, Any], key: str, label: str, spec: str = ".3f") -> str:
    value = record.get(key)
    return f"{label} {value:{spec}}" if isinstance(value, (int, float)) else ""


def _line(r: dict[str, Any], total: int) -> str:
    if r.get("kind") == "eval":
        return (f"[bold cyan]eval[/] step {r['step']}: accuracy {r.get('eval_accuracy', 0):.1%}, "
                f"format {r.get('eval_format', 0):.1%}, reward {r.get('eval_reward', 0):.3f} on {r.get('eval_samples', 0)} prompts")
    phases = " ".join(f"{k.removeprefix('time_')} {v:.1f}" for k, v in r.items() if k.startswith("time_") and k != "time_step")
    parts = [f"[bold]step {r['step']}/{total}[/]", _fmt(r, "reward_mean", "reward"), _fmt(r, "accuracy", "acc", ".2f"),
             _fmt(r, "kl", "kl", ".4f"), _fmt(r, "entropy", "ent", ".2f"), _fmt(r, "grad_norm", "|g|", ".3f"),
             _fmt(r, "logprob_diff_mean", "lp-diff", ".1e"), _fmt(r, "time_step", "", ".1f") + "s", f"[dim]({phases})[/]"]
    if r.get("reward_error"):
        parts.append(f"[red]reward errors {r['reward_error']}[/]")
    return "  ".join(p for p in parts if p)
