"""`rlbridge report` on a real run: a 2-step `rlbridge train` of a tiny random Llama (Ray, hf trainer + hf
rollout, LoRA, every logger on), then the report, the loggers' files and the run status read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlbridge.report import PLOTS
from tests.fixtures.tiny_llama import build_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def rlbridge(
    *args: str, env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlbridge", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    model_dir = build_tiny_llama(tmp / "model")
    recipe = {
        "name": "report-run",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16, "targets": ["all-linear"]},
        "trainer": {"engine": "hf", "micro_batch_size": 4, "optim": {"lr": 1e-2}},
        "rollout": {
            "engine": "hf",
            "n": 4,
            "max_prompt_tokens": 64,
            "max_response_tokens": 16,
            "weight_sync": "merged",
        },
        "algorithm": {"name": "grpo", "kl": {"coef": 0.01}},
        "data": {
            "train": {"path": "builtin:arithmetic"},
            "val": {"path": "builtin:arithmetic"},
            "batch_size": 2,
            "arithmetic": {"num_train": 20, "num_val": 4},
        },
        "reward": {"fn": "tests.fixtures.toy_rewards:length", "workers": 1},
        "eval": {
            "metrics": [{"term": "tests.fixtures.toy_rewards:length", "threshold": 0.1, "name": "accuracy"}]
        },
        "run": {"steps": 2, "eval_samples": 4, "loggers": ["console", "jsonl", "tensorboard", "wandb"]},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"},
    }
    rfile = tmp / "recipe.yaml"
    rfile.write_text(yaml.safe_dump(recipe))
    out = tmp / "run"
    res = rlbridge("train", str(rfile), "--run-dir", str(out), env={"WANDB_MODE": "offline"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return out


def test_report_of_a_real_run(run_dir: Path, tmp_path: Path) -> None:
    res = rlbridge("report", str(run_dir), "--out", str(tmp_path / "rep"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "finished" in res.stdout
    for name in PLOTS:
        png = tmp_path / "rep" / name
        assert png.is_file() and png.stat().st_size > 5000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "# Run report: report-run" in md and "**finished**" in md and "2 done of 2 planned" in md
    assert all(f"]({name})" in md for name in PLOTS)
    assert "| checkpoints | step 2 |" in md  # the loop's final save, found through its manifest
    for phase in ("generate", "reward", "update", "sync", "ref_logprobs"):
        assert f"| {phase} |" in md, phase
    assert "| accuracy | " in md and "(step 0)" in md and "(step 2)" in md  # first and last evaluation


def test_status_and_loggers_of_a_real_run(run_dir: Path) -> None:
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished"
    from rlbridge.metrics.tensorboard import read_scalars

    tb = read_scalars(run_dir / "logs" / "tensorboard")
    assert [s for s, _ in tb["train/reward_mean"]] == [1, 2] and [s for s, _ in tb["eval/eval_accuracy"]] == [
        0,
        2,
    ]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records if r["kind"] == "train"}
    assert all(abs(v - by_step[s]["reward_mean"]) < 1e-6 for s, v in tb["train/reward_mean"])
    from rlbridge.metrics.wandb import read_config, read_history

    (wb_run,) = (run_dir / "logs" / "wandb").glob("offline-run-*")
    rows = [r for r in read_history(wb_run) if "train/reward_mean" in r]
    assert [r["_step"] for r in rows] == [1, 2]
    assert read_config(wb_run)["name"] == "report-run"
