"""When `rlbridge train` reaches each start-up mark (run directory, Ray up, workers asked for, trainer loaded, vLLM
up, step 1 done), for two versions of one source file, alternated round by round (A B A B ...).

    python bench/startup_marks.py --file rlbridge/session.py --variant before=/tmp/session_before.py \\
        --variant after=/tmp/session_after.py --rounds 3 --out /tmp/marks.json

Each run: `rlbridge train RECIPE --set run.steps=1 --set data.val=null` (default recipes/quickstart.yaml) with the
variant's copy of --file in place; the file as it was is put back at the end. Seconds from the command's start to
the first console line holding each mark; every run kept in --out, the medians printed per variant.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKS = {
    "run directory": "run_dir",
    "ray started": "ray_up",
    "starting the trainer": "workers_asked",
    "model loaded": "trainer_loaded",
    "vLLM engine up": "vllm_up",
    "step 1/1": "step1_done",
    "done ": "done",
}


def one_run(recipe: str, run_dir: Path) -> dict[str, Any]:
    """The marks of one `rlbridge train` run, its exit code and, when it failed, its last 20 console lines."""
    start, seen, tail = time.monotonic(), {}, collections.deque(maxlen=20)
    cmd = [sys.executable, "-m", "rlbridge", "train", recipe, "--set", "run.steps=1", "--set", "data.val=null",
           "--run-dir", str(run_dir)]  # fmt: skip
    env = {**os.environ, "COLUMNS": "400"}  # the console's lines unwrapped (rich's width under a pipe is 80)
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    ) as p:
        assert p.stdout is not None
        for line in p.stdout:
            tail.append(line.rstrip())
            for text, name in MARKS.items():
                if text in line and name not in seen:
                    seen[name] = round(time.monotonic() - start, 2)
                    if name == "vllm_up":  # it names vLLM's start-up phases: load, compile, CUDA graphs
                        seen["vllm_up_line"] = line.strip()
    out: dict[str, Any] = {**seen, "returncode": p.returncode}
    if p.returncode:
        out["tail"] = list(tail)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, required=True, help="the source file the variants replace")
    ap.add_argument("--variant", action="append", required=True, help="NAME=PATH of that file's version")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--recipe", default="recipes/quickstart.yaml")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    variants = dict(v.split("=", 1) for v in a.variant)
    target = ROOT / a.file
    original = target.read_bytes()
    runs = []
    try:
        for k in range(a.rounds):
            for name, path in variants.items():
                shutil.copy(path, target)
                with tempfile.TemporaryDirectory() as tmp:
                    runs.append({"round": k, "variant": name, **one_run(a.recipe, Path(tmp) / "run")})
                print(json.dumps(runs[-1]), flush=True)
    finally:
        target.write_bytes(original)
    a.out.write_text(json.dumps({"command": sys.argv, "runs": runs}, indent=1) + "\n")
    for name in variants:
        mine = [r for r in runs if r["variant"] == name]
        med = {
            m: statistics.median(r[m] for r in mine if m in r and not r["returncode"])
            for m in MARKS.values()
            if any(m in r and not r["returncode"] for r in mine)
        }
        print(name, json.dumps(med))


if __name__ == "__main__":
    main()
