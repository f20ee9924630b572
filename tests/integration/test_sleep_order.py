"""Colocated GPUs: vLLM must be asleep before the trainer's first pass of a step, the reference log-probs (KL) and
PPO's values included, not only before the update: at 7B a reference pass's float32 logits (30 GiB at a
77,824-token budget) beside an awake vLLM ran out of memory although the plan, which counts vLLM asleep
through every trainer pass, had accepted the budget. The loop's train_step in-process (tiny Llama, hf engine,
hf rollout); the rollout memory's state machine runs on CPU too (its transitions are no-ops there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlbridge.loop import train_step
from rlbridge.rollout.memory import RolloutState
from tests.fixtures.local_session import local_session
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.integration.test_algorithms_learn import make_recipe

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("algorithm", [{"name": "grpo", "kl": {"coef": 0.05}}, {"name": "ppo"}])
def test_the_rollout_sleeps_before_every_trainer_pass(tmp_path: Path, algorithm: dict[str, Any]) -> None:
    model_dir = build_tiny_llama(tmp_path / "tiny")
    recipe = make_recipe(model_dir, algorithm, steps=1)
    seen: list[tuple[str, RolloutState]] = []
    with local_session(recipe, tmp_path / "run", model_dir) as s:
        trainer = s.started_trainer()
        for name in ("logprobs", "values", "update"):
            inner = getattr(trainer, name)

            def spy(*args: Any, _name: str = name, _inner: Any = inner, **kwargs: Any) -> Any:
                seen.append((_name, s.memory.state))
                return _inner(*args, **kwargs)

            setattr(trainer, name, spy)
        assert train_step(s, 1) is not None
    passes = {name for name, _ in seen}
    assert {"update", "values" if algorithm["name"] == "ppo" else "logprobs"} <= passes, seen
    assert all(state is RolloutState.ASLEEP for _, state in seen), seen
