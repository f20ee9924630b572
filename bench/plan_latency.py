"""How long `rlbridge plan RECIPE --json` takes, for every shipped recipe: the promise is that a recipe's plan
prints in seconds on a laptop (everything up to the plan imports no heavy library). Each recipe is planned
`--repeats` times in a fresh process (interpreter start and imports included), alternating the recipes.

    python bench/plan_latency.py --repeats 3 [--no-save]

Prints JSON and a markdown table (median and max seconds per recipe); keeps a dated copy in bench/results/.
Recipes whose data files are absent here are planned with builtin:arithmetic data (the plan does not read
the data). This was test_cli's wall-clock assertion (< 5 s for the 7B recipe); the test keeps the functional part.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402

BUILTIN_DATA = ["--set", "data.train.path=builtin:arithmetic", "--set", "data.val.path=builtin:arithmetic"]


def plan_seconds(recipe: Path) -> float | None:
    """Seconds of one `rlbridge plan` (builtin data; without the model checks when its model is not here), or
    None when the recipe does not plan on this machine."""
    for extra in ([], ["--no-model-checks"]):
        start = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-m", "rlbridge", "plan", str(recipe), "--json", *BUILTIN_DATA, *extra],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if res.returncode == 0:
            return time.perf_counter() - start
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    times: dict[str, list[float]] = {r.name: [] for r in recipes}
    for _ in range(args.repeats):
        for recipe in recipes:
            seconds = plan_seconds(recipe)
            if seconds is not None:
                times[recipe.name].append(seconds)
    rows = [
        {"recipe": name, "median_s": statistics.median(t), "max_s": max(t), "runs": len(t)}
        for name, t in times.items()
        if t
    ]
    report("plan_latency", {"repeats": args.repeats}, rows, save=not args.no_save)


if __name__ == "__main__":
    main()
