"""Read a run directory as far as it is written: the resolved recipe, the metric records, the status.

A running run's metrics.jsonl may end in a half-written line and a killed one may hold a torn line:
unreadable lines are skipped and counted. Non-finite numbers come back as floats (the jsonl writer stores
them as the strings "nan" / "inf").
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlbridge.errors import RlbridgeError
from rlbridge.run.directory import STATUS_FILE, read_status
from rlbridge.run.process import pid_alive

NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "Infinity": float("inf")}
RECENT_S = 600.0
"""Without a status file, a metrics.jsonl written in the last 10 minutes counts as a run still going."""


@dataclass(frozen=True)
class Status:
    state: str
    """finished | running | stopped | crashed | incomplete"""
    detail: str


@dataclass
class RunData:
    run_dir: Path
    recipe: dict[str, Any]
    """The resolved recipe as saved in recipe.yaml (for display; {} when missing)."""
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    status: Status
    bad_lines: int = 0
    checkpoints: list[int] = field(default_factory=list)
    """Steps of the checkpoints whose manifest exists (written last, so the save finished)."""

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.recipe
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def steps_done(self) -> int:
        return max((int(r["step"]) for r in self.train), default=0)

    @property
    def steps_planned(self) -> int | None:
        steps = self.get("run.steps")
        return int(steps) if isinstance(steps, int) else None


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a metrics.jsonl and the number of unreadable lines."""
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if not isinstance(rec, dict) or "step" not in rec:
            bad += 1
            continue
        records.append({k: NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in rec.items()})
    return records, bad


def checkpoint_steps(run_dir: Path) -> list[int]:
    steps = []
    for manifest in (run_dir / "checkpoints").glob("step_*/manifest.json"):
        try:
            steps.append(int(manifest.parent.name.removeprefix("step_")))
        except ValueError:
            continue
    return sorted(steps)


def _ago(seconds: float) -> str:
    return (
        f"{seconds:.0f} s ago"
        if seconds < 120
        else f"{seconds / 60:.0f} min ago"
        if seconds < 7200
        else f"{seconds / 3600:.1f} h ago"
    )


def run_status(run_dir: Path, planned: int | None, done: int, evals: list[dict[str, Any]]) -> Status:
    """finished / running / stopped / crashed from status.json (pid and host); without one, inferred from the files."""
    progress = f"step {done} of {planned if planned is not None else '?'}"
    metrics = run_dir / "metrics.jsonl"
    last_write = time.time() - metrics.stat().st_mtime if metrics.is_file() else None
    st = read_status(run_dir)
    if st is not None:
        state, pid, host = st.get("state"), st.get("pid"), st.get("host")
        if state == "finished":
            return Status("finished", f"{done} steps")
        # interrupted: SIGTERM, Ctrl-C or run.time_limit_s after a save, resumable (the message says how)
        if state == "interrupted":
            return Status("stopped", f"at {progress}: {st.get('error') or state}")
        if state == "failed":
            return Status("crashed", f"failed at {progress}: {st.get('error') or state}")
        if state == "running":
            if host == socket.gethostname() and isinstance(pid, int):
                if pid_alive(pid, python_only=True):
                    return Status("running", f"{progress}, process {pid}")
                return Status(
                    "crashed", f"process {pid} ended at {progress} without writing a final status (killed?)"
                )
            seen = f", metrics written {_ago(last_write)}" if last_write is not None else ""
            return Status("running", f"{progress} on host {host} (not checked from here{seen})")
    # no status.json (a run from before it existed, or a copied metrics file): infer from the files
    final_eval = planned is not None and any(int(r["step"]) == planned for r in evals)
    if planned is not None and done >= planned and (final_eval or not evals):
        return Status("finished", f"{done} steps (inferred: no {STATUS_FILE})")
    if last_write is not None and last_write < RECENT_S:
        return Status(
            "running", f"{progress}, metrics written {_ago(last_write)} (inferred: no {STATUS_FILE})"
        )
    return Status("incomplete", f"{progress} and no {STATUS_FILE}: stopped early or still starting")


def _last_per_step(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the last one written (a resumed run repeats the steps after its checkpoint)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]


def read_run(run_dir: Path) -> RunData:
    if not run_dir.is_dir():
        raise RlbridgeError(f"{run_dir} is not a directory")
    recipe_file, metrics_file = run_dir / "recipe.yaml", run_dir / "metrics.jsonl"
    if not recipe_file.is_file() and not metrics_file.is_file():
        raise RlbridgeError(
            f"{run_dir} holds no run (neither recipe.yaml nor metrics.jsonl): pass the directory `rlbridge train` printed"
        )
    recipe: dict[str, Any] = {}
    if recipe_file.is_file():
        loaded = yaml.safe_load(recipe_file.read_text(encoding="utf-8"))
        recipe = loaded if isinstance(loaded, dict) else {}
    records, bad = read_metrics(metrics_file)
    train = _last_per_step(r for r in records if r.get("kind", "train") == "train")
    evals = _last_per_step(r for r in records if r.get("kind") == "eval")
    data = RunData(run_dir, recipe, train, evals, Status("", ""), bad, checkpoint_steps(run_dir))
    data.status = run_status(run_dir, data.steps_planned, data.steps_done, evals)
    return data
