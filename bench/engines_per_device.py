"""Two rollout engines on one device against one (issue 43): generation speed, step time, sleep/wake, samples.

Runs `rlbridge train RECIPE` twice per round, alternated (round r: 1 engine then 2 when r is even, 2 then 1 when
odd), each with `rollout.engines_per_device` K, `run.save_rollouts` on and the same seed; the other settings come
from the recipe and `--set`. Per run: the median over the timed steps (the first `--warmup` steps dropped) of
the step, generate, update and sync times, generated tokens per second of generation (`tokens / time_generate`),
the sleep and wake seconds, the trainer's GPU peak, the device's peak (nvidia-smi, every process on GPU 0) beside
`rlbridge plan`'s estimates (trainer, rollout engines, peak); and, per step, the fraction of samples whose completion is
token for token the same as the 1-engine run's of the same round (every prompt group draws from its own seed, so
on a CPU they are all the same; on a GPU a different batch composition may change bf16 numerics).

    python bench/engines_per_device.py --recipe recipes/quickstart-gpu.yaml --out DIR [--rounds 1] [--steps 4]
        [--warmup 1] [--share 0.3] [--set KEY=VALUE ...]

Writes DIR/engines_per_device.json (every run's records kept) and prints one line per run and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import keep_log, machine, rlbridge_train  # noqa: E402
from bench.growth import DevicePeak, plan_gib  # noqa: E402

TIMES = ("time_step", "time_generate", "time_update", "time_sync", "sleep_s", "wake_s")


def records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def completions(run_dir: Path, step: int) -> list[list[int]]:
    path = run_dir / "rollouts" / f"step_{step:06d}.jsonl"
    return [json.loads(line)["response_ids"] for line in path.read_text().splitlines()]


def summarize(recs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    timed = recs[warmup:] or recs
    out: dict[str, Any] = {}
    for key in TIMES:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        out[key] = statistics.median(vals) if vals else None
    gen = [r["tokens"] / r["time_generate"] for r in timed if r.get("time_generate")]
    out["generated_tokens_per_s"] = statistics.median(gen) if gen else None
    peaks = [r["trainer_gpu_gib_max"] for r in recs if r.get("trainer_gpu_gib_max") is not None]
    out["trainer_gpu_gib_max"] = max(peaks) if peaks else None
    return out


def same_fraction(a: Path, b: Path, steps: list[int]) -> list[float]:
    """Per step: the share of samples of run b whose token ids equal run a's at the same batch position."""
    fractions = []
    for step in steps:
        x, y = completions(a, step), completions(b, step)
        fractions.append(sum(p == q for p, q in zip(x, y, strict=True)) / len(x))
    return fractions


def device_size() -> list[str]:
    """`cluster.gpu_memory_gib` of this machine's GPU 0 (nvidia-smi), so that the plan is made for the card the
    run is on (rlbridge train refuses a recipe whose planned peak exceeds the real card); none without it."""
    from rlbridge.run.gpu_faults import nvidia_smi

    out = (nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0") or "").strip()
    return [f"cluster.gpu_memory_gib={int(float(out) / 1024 * 10) / 10}"] if out else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/quickstart-gpu.yaml")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--share", type=float, default=0.3, help="rollout.gpu_memory_utilization of each engine")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--only", type=int, choices=(1, 2), help="run only this engine count (no comparison)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    base = [
        *device_size(),
        *a.sets,
        f"run.steps={a.steps}",
        "run.save_rollouts=true",
        "run.save_every=0",
        f"rollout.gpu_memory_utilization={a.share}",
    ]
    runs: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        dirs: dict[int, Path] = {}
        for k in [a.only] if a.only else (1, 2) if rnd % 2 == 0 else (2, 1):
            run_dir = a.out / f"r{rnd}-engines{k}"
            sets = [*base, f"rollout.engines_per_device={k}"]
            with DevicePeak() as device:
                wall = rlbridge_train(a.recipe, run_dir, sets)
            for log_file in sorted((run_dir / "logs").glob("*.log")):  # each engine's load and sync lines
                keep_log(log_file, a.out / f"{run_dir.name}.{log_file.name}")
            recs = records(run_dir)
            dirs[k] = run_dir
            row = {
                "round": rnd,
                "engines": k,
                "wall_s": wall,
                **summarize(recs, a.warmup),
                "device_peak_gib": None if device.peak_mib is None else device.peak_mib / 1024,
                **plan_gib(a.recipe, sets),
                "records": recs,
            }
            runs.append(row)
            print(
                f"round {rnd} engines {k}: step {row['time_step']:.3f} s, generate {row['time_generate']:.3f} s "
                f"({row['generated_tokens_per_s']:.0f} tok/s), update {row['time_update']:.3f} s, "
                f"sync {row['time_sync']:.3f} s, sleep {row['sleep_s']} s, wake {row['wake_s']} s, wall {wall:.0f} s; "
                f"device peak {row['device_peak_gib']} GiB, plan rollout {row.get('plan_rollout_gib')} "
                f"trainer {row.get('plan_trainer_gib')} peak {row.get('plan_peak_gib')} GiB",
                flush=True,
            )
        if a.only:
            continue
        steps = [r["step"] for r in records(dirs[1])]
        fractions = same_fraction(dirs[1], dirs[2], steps)
        runs[-1]["same_as_one_engine"] = runs[-2]["same_as_one_engine"] = fractions
        print(f"round {rnd}: identical completions per step (2 engines vs 1): {fractions}", flush=True)
    one = [r for r in runs if r["engines"] == 1]
    two = [r for r in runs if r["engines"] == 2]
    ratios = {
        key: statistics.median(r[key] for r in one) / statistics.median(r[key] for r in two)
        for key in ("time_step", "time_generate")
        if one and two and all(r[key] for r in runs)
    }
    print(f"1 engine / 2 engines (median over rounds; > 1: two are faster): {ratios}", flush=True)
    result = {
        "recipe": a.recipe,
        "sets": base,
        "warmup": a.warmup,
        "machine": machine(),
        "ratios": ratios,
        "runs": runs,
    }
    (a.out / "engines_per_device.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
