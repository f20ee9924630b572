"""Synchronous vs asynchronous rollouts (rollout.mode, docs/async.md), side by side in one invocation.

    python bench/async_runs.py [--recipe recipes/quickstart.yaml] [--steps 20] [--seeds 1 2 3]
                               [--staleness 1] [--set KEY=VALUE ...] [--async-set KEY=VALUE ...]
                               [--out DIR] [--json PATH] [--no-save]
    python bench/async_runs.py --combine A.json B.json ...   # one report from runs made in several invocations

For each seed, `rlbridge train RECIPE` once with rollout.mode sync and once with async (max_staleness k), the
same seed, steps and every other key (async runs also get --async-set: by default token TIS, as docs/async.md
recommends). --combine merges the --json files of several invocations (one seed each, say, when one device
call cannot hold all the runs) into one report, as if they had run in one. Per run: seconds per step in the steady state (the mean of time_step over
steps 2..N: every phase the driver waits on, so generation that overlaps the update is not counted twice;
step 1 waits for a generation nothing overlapped), steps per minute, the mean reward of the last 5 steps, the
greedy held-out accuracy at the end, and the mean staleness. Then the async / sync ratio of steps per minute
per seed and the mean held-out accuracy of each mode. Prints JSON and a table; with --save (the default) a
dated copy in bench/results/async_runs-DATE.{json,md}. The load average before and after is recorded: on a
machine shared with other work the ratio is not a property of rlbridge alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report, rlbridge_train  # noqa: E402
from rlbridge.report.run import read_run  # noqa: E402

TOKEN_TIS = "algorithm.rollout_correction.weights=token"  # recommended with async (docs/async.md)


def summarize(run_dir: Path, wall: float) -> dict[str, Any]:
    run = read_run(run_dir)
    steps = run.train
    steady = [float(r["time_step"]) for r in steps[1:]] or [float(steps[0]["time_step"])]
    per_step = statistics.fmean(steady)
    return {
        "s_per_step": per_step,
        "steps_per_min": 60.0 / per_step,
        "reward_last5": statistics.fmean(float(r["reward_mean"]) for r in steps[-5:]),
        "eval_accuracy": float(run.evals[-1]["eval_accuracy"]) if run.evals else float("nan"),
        "staleness_mean": statistics.fmean(float(r.get("staleness", 0)) for r in steps),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--async-set",
        dest="async_sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only for the async runs (default: algorithm.rollout_correction.weights=token, docs/async.md)",
    )
    ap.add_argument("--out", type=Path, default=None, help="keep the run directories here")
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=["sync", "async"],
        default=["sync", "async"],
        help="run only these (a seed's other run can come from an earlier --json through --combine)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the result document here")
    ap.add_argument(
        "--combine", type=Path, nargs="+", default=None, metavar="JSON", help="merge these results"
    )
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    if a.combine:
        docs = [json.loads(p.read_text()) for p in a.combine]
        rows = [r for d in docs for r in d["rows"]]
        first = docs[0]
        seeds = list(dict.fromkeys(s for d in docs for s in d["seeds"]))  # a seed may come from two documents
        result = summary(
            first["recipe"],
            first["steps"],
            seeds,
            first["max_staleness"],
            first["sets"],
            first["async_sets"],
            rows,
        )
        result["combined_from"] = [{"command": d["command"], "date": d["machine"]["date"]} for d in docs]
        doc = report("async_runs", result, rows, save=not a.no_save)
    else:
        doc = run_modes(a)
    if a.json:
        a.json.write_text(json.dumps(doc, indent=2) + "\n")


def run_modes(a: argparse.Namespace) -> dict[str, Any]:
    """Every seed x mode of `a` as a child `rlbridge train`; returns report()'s document."""
    out = a.out or Path(tempfile.mkdtemp(prefix="rlbridge-async-"))
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    for seed in a.seeds:
        for mode in a.modes:
            sets = [f"run.seed={seed}", f"run.steps={a.steps}", f"rollout.mode={mode}", *a.sets]
            if mode == "async":
                sets += [f"rollout.max_staleness={a.staleness}", *(a.async_sets or [TOKEN_TIS])]
            run_dir = out / f"{mode}-seed{seed}"
            wall = rlbridge_train(a.recipe, run_dir, sets)
            row = {"mode": mode, "seed": seed, **summarize(run_dir, wall)}
            rows.append(row)
            print(f"{mode} seed {seed}: {json.dumps(row)}", file=sys.stderr)  # kept if a later run fails
    result = summary(a.recipe, a.steps, a.seeds, a.staleness, a.sets, a.async_sets or [TOKEN_TIS], rows)
    result["load_average_before_after"] = [load_before, os.getloadavg()[0]]
    result["run_dirs"] = str(out)
    return report("async_runs", result, rows, save=not a.no_save)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")  # nan: no seed has both runs


def summary(
    recipe: str,
    steps: int,
    seeds: list[int],
    staleness: int,
    sets: list[str],
    async_sets: list[str],
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """The async / sync ratio of steps per minute per seed and each mode's mean held-out accuracy, over the seeds
    that have both runs (a run cut short, say by a device call's limit, leaves its seed unpaired: listed, not
    averaged)."""
    paired = [s for s in seeds if {r["mode"] for r in rows if r["seed"] == s} == {"sync", "async"}]
    ratios = []
    for seed in paired:
        sync, asyn = (
            next(r for r in rows if r["seed"] == seed and r["mode"] == m) for m in ("sync", "async")
        )
        ratios.append(asyn["steps_per_min"] / sync["steps_per_min"])
    acc = {
        m: mean([r["eval_accuracy"] for r in rows if r["mode"] == m and r["seed"] in paired])
        for m in ("sync", "async")
    }
    return {
        "recipe": recipe,
        "steps": steps,
        "seeds": seeds,
        "max_staleness": staleness,
        "sets": sets,
        "async_sets": async_sets,
        "async_over_sync_steps_per_min": ratios,
        "async_over_sync_mean": mean(ratios),
        "eval_accuracy_mean": acc,
        "unpaired_seeds": [s for s in seeds if s not in paired],
    }


if __name__ == "__main__":
    main()
