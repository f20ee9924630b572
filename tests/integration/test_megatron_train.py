"""`rlbridge train` with the megatron engine on CPU: every rank a Ray actor on its placement-group bundle,
the ranks' own gloo group, driven by the loop through TrainerGroup; vLLM-CPU (or hf) rollouts.

* recipes/smoke-megatron-cpu.yaml at tensor 2 x pipeline 2 (4 ranks): float32 trainer log-probs equal
  vLLM's, gradients flow, weight versions count up, the reference (adapters off) path runs;
* data parallel 2 (2 ranks);
* a rank killed mid-run stops the run with that rank's error within seconds, not at the gloo timeout;
* `--smoke` on the Qwen2.5-7B recipe (its config.json only): tensor 2, sequence parallel turned off.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def test_a_killed_rank_stops_the_run_within_seconds(env: dict[str, str], tmp_path: Path) -> None:
    args = [
        "recipes/smoke-megatron-cpu.yaml",
        "--set",
        "run.steps=50",
        "--set",
        "rollout.engine=hf",
        "--set",
        "trainer.parallel.tensor=1",
        "--set",
        "cluster.gpus_per_node=2",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbridge", "train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    killed_at = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed_at is None and line.startswith("step 1/"):
                victim = next(c for c in rank_lines("".join(lines)) if c[0] == 1)
                os.kill(victim[1], signal.SIGKILL)
                killed_at = time.monotonic()
            if killed_at is not None and "error:" in line:
                break
        error_after = time.monotonic() - killed_at if killed_at else None
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    out = " ".join(("".join(lines) + (proc.stdout.read() if proc.stdout else "")).split())
    assert killed_at is not None, out[-5000:]
    assert error_after is not None and error_after < 20, (
        f"no error {error_after} s after the kill:\n{out[-5000:]}"
    )
    assert rc == 1, out[-5000:]
    assert re.search(r"trainer rank 1 \(dp 0, tp 0, pp 1\) worker died", out), out[-5000:]
    assert "all trainer ranks were stopped" in out
    print(f"error {error_after:.1f} s after the kill")


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
