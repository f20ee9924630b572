"""Session's start with Ray (rlbridge/session.py): Ray comes up while the tokenizer loads in a thread, and a start
that fails after it (the training data gone) leaves no Ray behind and names what failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from rlbridge.errors import RlbridgeError
from rlbridge.model.info import read_model_info
from rlbridge.plan import make_plan
from rlbridge.recipe.schema import Recipe
from rlbridge.session import Session
from tests.fixtures.tiny_llama import build_tiny_llama

pytestmark = pytest.mark.slow


def test_a_start_that_fails_after_ray_came_up_shuts_it_down(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model_dir = build_tiny_llama(tmp_path / "tiny")
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    recipe = Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "rollout": {"engine": "hf", "n": 2, "max_response_tokens": 8},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": str(data)}, "batch_size": 2},
            "cluster": {"device": "cpu"},
        }
    )
    plan = make_plan(recipe, read_model_info(str(model_dir)))
    data.unlink()  # after the plan (and what validate-recipe would read), before the session reads it
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert not ray.is_initialized()
    with pytest.raises(RlbridgeError, match="train.jsonl"), Session(recipe, plan, run_dir, model_dir):
        pass
    assert not ray.is_initialized()
    assert "ray started" in capfd.readouterr().err  # Ray was up when the data was found missing
