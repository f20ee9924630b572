"""PPO trains on the megatron engine on CPU (issue #7): policy and critic are megatron models built through
Megatron-Bridge (LoRA each, the critic's output layer a value head), one gloo rank, driven by the loop's
train_step with the hf rollout, on test_ppo_learn.py's easy task (ASCII fraction of the completion, tiny
random Llama, seed 3). The run happens in a subprocess (tests/integration/megatron_ppo_run.py), so this
pytest process never imports megatron.

The shipped recipe recipes/ppo-megatron-smoke-cpu.yaml then runs through `rlbridge train`: tensor 2 (two Ray
rank actors, each with policy + critic), vLLM-CPU rollouts, 2 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.tiny_llama import build_tiny_llama
from tests.integration.test_algorithms_learn import MARGIN, WINDOW
from tests.integration.test_megatron_train import check_steps, env, rank_lines, train  # noqa: F401  (env: fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HERE = Path(__file__).resolve().parent


def test_ppo_on_megatron_reward_goes_up(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "records.json"
    run_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2"}
    start = time.time()
    res = subprocess.run([sys.executable, str(HERE / "megatron_ppo_run.py"), str(model_dir), str(tmp_path / "run"),
                          str(out)], cwd=HERE.parents[1], env=run_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    result = json.loads(out.read_text())
    assert (result["engine"], result["critic"]) == ("MegatronTrainEngine", "MegatronCritic")
    records = result["records"]
    assert all(r is not None for r in records)
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    print(f"ppo (megatron) {time.time() - start:.0f} s", [round(x, 3) for x in rewards],
          [round(r["value_ev"], 3) for r in records])
    assert last > first + MARGIN, rewards
    assert all(r["grad_norm"] > 0 and r["critic_grad_norm"] > 0 for r in records[:WINDOW])
    assert all(r["skipped"] == 0 and r["critic_skipped"] == 0 for r in records)
    assert all({"value_ev", "vf_loss", "vf_clip_frac", "time_values"} <= set(r) for r in records)


def test_ppo_recipe_at_tensor_2_through_the_cli(env: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    out, records = train(env, tmp_path / "run", "recipes/ppo-megatron-smoke-cpu.yaml", "--set", "run.steps=2")
    check_steps(records, 2)
    assert [c[2:] for c in rank_lines(out)] == [(0, 0, 0), (0, 1, 0)]
    for r in records:
        assert r["critic_skipped"] == 0 and r["critic_grad_norm"] > 0 and r["time_values"] > 0, r
        assert {"value_ev", "value_mean", "vf_loss", "vf_clip_frac"} <= set(r)
