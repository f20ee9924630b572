"""The run directory: resolved recipe, plan, metrics, checkpoints and logs, in the layout of ARCHITECTURE.md."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import Recipe


def choose_run_dir(recipe: Recipe, override: Path | None) -> Path:
    if override is not None:
        return override
    if recipe.run.dir:
        return Path(recipe.run.dir)
    return Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolved_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def create(run_dir: Path, recipe: Recipe, plan: dict[str, Any]) -> Path:
    """A new run directory with the resolved recipe and `plan` (Plan.to_dict()) in it; refuses one that already
    holds a run (use `rlbridge resume` for that)."""
    if (run_dir / "recipe.yaml").exists():
        raise RlbridgeError(
            f"{run_dir} already holds a run: continue it with `rlbridge resume {run_dir}` or choose another --run-dir"
        )
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    (run_dir / "recipe.yaml").write_text(resolved_yaml(recipe), encoding="utf-8")
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=2), encoding="utf-8")
    return run_dir


def log_file(run_dir: Path, role: str) -> Path:
    """RUN_DIR/logs/<role>.log: the output of one process role, so that the console keeps rlbridge's own
    lines (rlbridge/cluster/logs.py routes it). Roles: `rollout` (the rollout actor: vLLM at INFO, its engine
    core and tensor-parallel workers), `trainer` (the hf trainer actor), `trainer-rank<i>` (rank i of a
    megatron trainer), `reward` (the reward worker processes: what user reward functions print), `driver`
    (the driver's library logging and Python warnings). Appended to: a resumed run adds to them."""
    return run_dir / "logs" / f"{role}.log"


def write_rollouts(run_dir: Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """RUN_DIR/rollouts/step_<N>.jsonl (run.save_rollouts): one JSON line per sample, written to a temporary
    file and renamed, so a reader (or a resumed run repeating the step) never sees half a file."""
    out = run_dir / "rollouts" / f"step_{step:06d}.jsonl"
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------------------------------ run status
STATUS_FILE = "status.json"
"""{"state": running | finished | failed | interrupted, "pid", "host", "time", "error"}: written when a
run starts and when it ends. A run killed without cleanup stays "running" with a dead pid: `rlbridge
report` calls that crashed."""


def write_status(run_dir: Path, state: str, *, error: str | None = None) -> None:
    info = {"state": state, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    if error:
        info["error"] = error
    tmp = run_dir / f".{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(info, indent=2), encoding="utf-8")
    tmp.replace(run_dir / STATUS_FILE)


def exit_state(exc_type: type[BaseException] | None) -> str:
    if exc_type is None:
        return "finished"
    return "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed"


def read_status(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
