"""Cost of growth: step time and peak memory of `rlbridge train` as the batch and the response length grow.

Each point is a run of the recipe of its own (a child `rlbridge train`, `--steps` steps, the first one a warm-up)
with `rollout.n` samples per prompt and `rollout.ignore_eos`, so every response is exactly
`max_response_tokens` long and the length axis means what it says. Two sweeps around one centre point:

- batch: rollouts per step in `--batches` (default 32, 512, 2048) at `--length` (default 256) tokens;
- length: `max_response_tokens` in `--lengths` (default 64, 256, 1024) at `--rollouts` (default 512) per step.

Per point: the median step time over the timed steps and its phases (generate, update, sync, ...), trained
tokens/s, the trainer's measured peak (`trainer_gpu_gib_max` of the train records, CUDA only), the peak device
memory of every process (nvidia-smi on GPU 0, sampled every 0.2 s; none without nvidia-smi) and
`rlbridge plan`'s estimates for the same recipe (trainer, rollout, peak per device), so goal 7 of issue 16 is
read off the same table. `--plot PNG` draws the two sweeps (step time and memory on log-log axes), from the
runs or, with `--from JSON`, from a saved result.

    python bench/growth.py --recipe recipes/quickstart-gpu.yaml --out DIR [--steps 3] [--set KEY=VALUE ...]
    python bench/growth.py --from bench/results/growth-gpu-2026-12-02.json --plot docs/img/growth-gpu.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report, rlbridge_train  # noqa: E402

PHASES = ("generate", "reward", "logprobs", "update", "sync")


class DevicePeak:
    """Peak memory used on the device while a run lasts: nvidia-smi's memory.used of GPU 0 (every process on it)
    when nvidia-smi exists, else None."""

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
        while not self._stop.wait(0.2):
            try:
                used = float(subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.strip())
            except (OSError, ValueError, subprocess.SubprocessError):
                continue
            self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)

    def __enter__(self) -> DevicePeak:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def plan_gib(recipe: str, sets: list[str]) -> dict[str, float]:
    """`rlbridge plan`'s per-device estimates for the run's recipe."""
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.info import read_model_info
    from rlbridge.plan import make_plan
    from rlbridge.recipe import load_recipe

    r = load_recipe(Path(recipe), sets)
    mem = make_plan(r, read_model_info(str(ensure_model(r.model.path)))).memory
    if mem is None:
        return {}
    return {
        "plan_trainer_gib": mem.trainer_total,
        "plan_rollout_gib": mem.rollout_total,
        "plan_peak_gib": mem.peak,
    }


def run_point(a: argparse.Namespace, rollouts: int, length: int) -> dict[str, Any]:
    n = a.n
    if rollouts % n:
        raise SystemExit(f"--batches/--rollouts must be multiples of rollout.n = {n}, got {rollouts}")
    sets = [
        f"data.batch_size={rollouts // n}",
        f"rollout.n={n}",
        f"rollout.max_response_tokens={length}",
        "rollout.ignore_eos=true",
        f"run.steps={a.steps}",
        "run.eval_every=0",
        "data.val=null",
        *a.sets,
    ]
    run_dir = a.out / f"r{rollouts}-l{length}"
    shutil.rmtree(run_dir, ignore_errors=True)
    with DevicePeak() as device:
        wall = rlbridge_train(str(a.recipe), run_dir, sets)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in records if x.get("kind") == "train"]
    timed = train[1:] or train  # the first step is the warm-up (compilation, first allocations)
    med = lambda key: statistics.median(float(x.get(key, 0.0)) for x in timed)  # noqa: E731
    step_s = med("time_step")
    peaks = [x["trainer_gpu_gib_max"] for x in train if "trainer_gpu_gib_max" in x]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {
        "rollouts": rollouts,
        "length": length,
        "steps_timed": len(timed),
        "step_s": step_s,
        **{f"{p}_s": med(f"time_{p}") for p in PHASES},
        "sleep_wake_s": med("sleep_s") + med("wake_s"),  # inside update_s and sync_s (colocated GPU only)
        "response_tokens_per_s": med("tokens") / step_s if step_s else 0.0,
        "trainer_peak_gib": max(peaks) if peaks else None,
        "device_peak_gib": None if device.peak_mib is None else device.peak_mib / 1024,
        **plan_gib(str(a.recipe), sets),
        "run_wall_s": wall,
    }


def points(a: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(sweep, rollouts, length), the centre point once (it belongs to both sweeps), smallest first."""
    out = [("batch", b, a.length) for b in a.batches]
    out += [
        ("length", a.rollouts, n)
        for n in a.lengths
        if (a.rollouts, n) not in {(b, a.length) for b in a.batches}
    ]
    return sorted(out, key=lambda p: p[1] * p[2])


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r.get("step_s")]
    s = doc["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, fixed, label in (
        (axes[0], "rollouts", ("length", s["length"]), "rollouts per step"),
        (axes[1], "length", ("rollouts", s["rollouts"]), "response tokens"),
    ):
        pts = sorted((r for r in rows if r[fixed[0]] == fixed[1]), key=lambda r: r[key])
        xs = [r[key] for r in pts]
        ax.plot(xs, [r["step_s"] for r in pts], "o-", color="tab:blue", label="step time (s)")
        ax.plot(xs, [r["update_s"] for r in pts], "s--", color="tab:blue", alpha=0.5, label="update (s)")
        ax.plot(xs, [r["generate_s"] for r in pts], "^--", color="tab:cyan", alpha=0.7, label="generate (s)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"{label} ({fixed[0]} {fixed[1]})")
        ax.set_ylabel("seconds")
        ax.set_xticks(xs, [str(x) for x in xs])
        mem = ax.twinx()
        mem.plot(
            xs, [r.get("device_peak_gib") or 0 for r in pts], "D-", color="tab:red", label="device peak (GiB)"
        )
        mem.plot(xs, [r.get("trainer_peak_gib") or 0 for r in pts], "v:", color="tab:red", alpha=0.6,
                 label="trainer peak (GiB)")  # fmt: skip
        mem.plot(xs, [r.get("plan_trainer_gib") or 0 for r in pts], "x:", color="tab:orange",
                 label="plan: trainer (GiB)")  # fmt: skip
        mem.set_ylabel("GiB")
        mem.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()
        more = mem.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=6, loc="lower right", framealpha=0.8)
    fig.suptitle(
        f"rlbridge step time and memory as the work grows ({s.get('device', '')}, {s['recipe']})", fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "quickstart-gpu.yaml")
    ap.add_argument(
        "--out", type=Path, default=Path("growth_runs"), help="run directories (kept, checkpoints removed)"
    )
    ap.add_argument("--steps", type=int, default=3, help="steps per run, the first one not timed")
    ap.add_argument("--n", type=int, default=8, help="rollout.n")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[32, 512, 2048])
    ap.add_argument("--length", type=int, default=256, help="response tokens of the batch sweep")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024])
    ap.add_argument("--rollouts", type=int, default=512, help="rollouts per step of the length sweep")
    ap.add_argument("--set", action="append", default=[], dest="sets", help="recipe override for every run")
    ap.add_argument("--device", default="", help="a name for the device, for the plot's title")
    ap.add_argument("--from", dest="from_json", type=Path, help="plot a saved result instead of running")
    ap.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    if a.from_json:
        if not a.plot:
            raise SystemExit("--from needs --plot")
        plot(json.loads(a.from_json.read_text()), a.plot)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "recipe": str(a.recipe.relative_to(ROOT) if a.recipe.is_absolute() and ROOT in a.recipe.parents else a.recipe),
        "steps": a.steps, "n": a.n, "length": a.length, "rollouts": a.rollouts, "sets": a.sets, "device": a.device,
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    for sweep, rollouts, length in points(a):
        start = time.perf_counter()
        print(f"[growth] {sweep}: {rollouts} rollouts x {length} tokens", file=sys.stderr, flush=True)
        rows.append({"sweep": sweep, **run_point(a, rollouts, length)})
        print(
            f"[growth] {json.dumps(rows[-1])} ({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        (a.out / "growth.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    doc = report("growth", {"settings": settings}, rows, save=not a.no_save)
    if a.plot:
        plot(doc, a.plot)


if __name__ == "__main__":
    main()
