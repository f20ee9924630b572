"""The run directory: resolved recipe, plan, metrics, checkpoints and logs, in the layout of ARCHITECTURE.md."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from rlbridge.errors import RlbridgeError
from rlbridge.plan import Plan
from rlbridge.recipe.schema import Recipe


def choose_run_dir(recipe: Recipe, override: Path | None) -> Path:
    if override is not None:
        return override
    if recipe.run.dir:
        return Path(recipe.run.dir)
    return Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolved_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def create(run_dir: Path, recipe: Recipe, plan: Plan) -> Path:
    """A new run directory; refuses one that already holds a run (use `rlbridge resume` for that)."""
    if (run_dir / "recipe.yaml").exists():
        raise RlbridgeError(f"{run_dir} already holds a run: continue it with `rlbridge resume {run_dir}` or choose another --run-dir")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    (run_dir / "recipe.yaml").write_text(resolved_yaml(recipe), encoding="utf-8")
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2), encoding="utf-8")
    return run_dir
