"""`rlbridge train recipes/moe-lora-cpu.yaml`: GRPO + LoRA (attention and every expert) on the tiny random Qwen3-MoE
with the megatron engine (1 CPU rank) and transformers rollouts, merged sync, driven by the loop (docs/moe.md).

Asserted: every step trained (grad norm > 0, nothing skipped) and passed the first-step gate, which checks each
expert the router sent tokens to; the float32 trainer's log-probs equal the rollout's (mean |diff| < 1e-5, max
< 1e-4; measured 1.2-2.0e-6 / 5.7e-6-1.1e-5) after every merged sync, so each expert's delta reached the rollout.
The comparison with the dense model of the same size, and in
bfloat16, is bench/moe_logprob_gap.py (figures in docs/moe.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_grpo_on_the_tiny_moe(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RLBRIDGE_CACHE": str(tmp_path / "cache"),
        "PYTHONWARNINGS": "ignore",
        "COLUMNS": "200",
    }
    run_dir = tmp_path / "run"
    start = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "rlbridge", "train", "recipes/moe-lora-cpu.yaml", "--set", "run.steps=3"]
        + ["--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    print(f"rlbridge train moe-lora-cpu (3 steps): {time.time() - start:.0f} s")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["skipped"] == 0 and r["grad_norm"] > 0, r
        assert r["logprob_diff_mean"] < 1e-5 and r["logprob_diff_max"] < 1e-4, r
