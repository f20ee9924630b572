"""PPO with its critic trains for real: the loop's train_step on the tiny random Llama (hf engine + LoRA for
policy and critic, hf rollout, in-process), with the helpers of test_algorithms_learn.py.

- the reward goes up on the ASCII-fraction task, as for the GRPO family;
- the critic learns: with a reward that depends on the prompt only (1 for an addition, 0 for a subtraction),
  a critic that reads the prompt can predict every return exactly (explained variance 1), one that only
  learned the mean return explains nothing (0). The explained variance of the returns by the values computed
  *before* each update (value_ev: out of sample, float64) must rise above 0.5;
- the adaptive KL controller follows Ziegler's formula step by step, and its coefficient, the critic and its
  optimizer come back from a checkpoint: a resumed step equals the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlbridge.checkpointer import Checkpointer
from rlbridge.loop import train_step
from rlbridge.recipe.schema import Recipe
from rlbridge.run.resume import find_checkpoint
from rlbridge.run.signals import StopSignals
from tests.fixtures.local_session import local_session
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.integration.test_algorithms_learn import MARGIN, WINDOW, make_recipe, run_steps

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def with_updates(recipe: Recipe, updates: dict[str, Any]) -> Recipe:
    raw = recipe.model_dump(mode="json")
    for dotted, value in updates.items():
        node = raw
        *parents, last = dotted.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return Recipe.model_validate(raw)


def test_ppo_reward_goes_up(model_dir: Path, tmp_path: Path) -> None:
    """Measured (seed 3): reward 0.42, 0.52, 0.40 over steps 1-3 -> 0.90, 0.97, 1.0 over steps 6-8."""
    records = run_steps(
        make_recipe(model_dir, {"name": "ppo", "critic": {"lr": 1e-2}}), model_dir, tmp_path / "run"
    )
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    print("ppo", [round(x, 3) for x in rewards], [round(r["value_ev"], 3) for r in records])
    assert last > first + MARGIN, rewards
    assert all(r["grad_norm"] > 0 and r["critic_grad_norm"] > 0 for r in records[:WINDOW])
    assert all({"value_ev", "vf_loss", "vf_clip_frac", "time_values"} <= set(r) for r in records)


EV_STEPS, EV_WINDOW, EV_THRESHOLD = 10, 3, 0.5
"""Measured (seed 3): value_ev -0.01, 0.19, 0.29, -0.53, 0.16, 0.59, 0.77, 0.86, 0.54, 0.93; the mean of the
last 3 (0.78) must beat 0.5: more than half the variance of the returns explained by the prompt, which a
critic that predicts the mean return (EV 0) or tracks only the batch's average cannot reach."""


def test_critic_explains_a_prompt_only_reward(model_dir: Path, tmp_path: Path) -> None:
    algorithm = {
        "name": "ppo",
        "gamma": 1.0,
        "lam": 1.0,
        "critic": {"lr": 1e-2},
    }  # lam 1: returns = the outcome
    recipe = with_updates(
        make_recipe(model_dir, algorithm, steps=EV_STEPS),
        {
            "reward": {"fn": "tests.fixtures.toy_rewards:plus_prompt", "workers": 1},
            "data.arithmetic.ops": ["+", "-"],
            "data.batch_size": 8,
            "data.mini_batch_size": 4,
            "rollout.n": 2,
            "rollout.max_response_tokens": 6,
            "trainer.ppo_epochs": 2,
            "trainer.micro_batch_size": 8,
        },
    )  # 8 prompts a step (both operators nearly always present), 4 critic steps a step
    records = run_steps(recipe, model_dir, tmp_path / "run")
    ev = [r["value_ev"] for r in records]
    print("value_ev", [round(x, 3) for x in ev])
    assert max(ev[:2]) < 0.3, ev  # the fresh critic knows nothing of the prompt
    assert sum(ev[-EV_WINDOW:]) / EV_WINDOW > EV_THRESHOLD, ev


def test_adaptive_kl_follows_ziegler_and_resumes_exactly(model_dir: Path, tmp_path: Path) -> None:
    target, horizon = 1.0, 64
    algorithm = {
        "name": "ppo",
        "critic": {"lr": 1e-2},
        "kl": {"coef": 0.01, "where": "reward", "estimator": "k1"},
        "adaptive_kl_target": target,
        "adaptive_kl_horizon": horizon,
    }
    recipe = make_recipe(model_dir, algorithm, steps=3)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with local_session(recipe, run_dir, model_dir) as s:
        saver = Checkpointer(s, StopSignals(), print)
        records = [train_step(s, 1), train_step(s, 2)]
        saver.save(2)
        records.append(train_step(s, 3))
    assert all(r is not None for r in records)
    coef = 0.01
    for r in records:  # the coefficient a step uses is the one the previous steps' KL left
        assert r is not None and r["kl_coef"] == coef
        coef *= 1.0 + min(max(r["kl_seq"] / target - 1.0, -0.2), 0.2) * 16 / horizon
    assert records[-1]["kl_coef"] != records[0]["kl_coef"]  # type: ignore[index]

    with local_session(recipe, run_dir, model_dir) as s:
        Checkpointer(s, StopSignals(), print).restore(find_checkpoint(run_dir))
        resumed = train_step(s, 3)
    assert resumed is not None and records[2] is not None
    assert resumed["rollout_sha"] == records[2]["rollout_sha"] and resumed["kl_coef"] == records[2]["kl_coef"]
    for key in (
        "kl_seq",
        "reward_mean",
        "value_ev",
        "value_mean",
        "vf_loss",
        "critic_grad_norm",
        "grad_norm",
    ):
        assert resumed[key] == pytest.approx(records[2][key], rel=1e-5), key  # rel 1e-5: see test_resume.py
