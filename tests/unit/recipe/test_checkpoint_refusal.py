"""A trainer layout that cannot be checkpointed is a recipe error at validation (recipe/checks/checkpoints.py),
naming the key, its YAML line and the fix; a run that reaches the trainer anyway stops before step 1 instead of
running without checkpoints."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rlbridge.checkpointer import Checkpointer
from rlbridge.errors import RecipeError, RlbridgeError
from rlbridge.recipe import validate_recipe
from rlbridge.run.signals import StopSignals

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


def recipe(**trainer: object) -> dict:
    return {
        "name": "t",
        "model": {"path": str(FIX / "qwen3-30b-a3b"), "dtype": "bfloat16"},
        "lora": {"rank": 8, "targets": ["linear_qkv"]},
        "trainer": {
            "engine": "megatron",
            "parallel": {"tensor": 1, "expert": 8},
            "micro_batch_size": 2,
            **trainer,
        },
        "rollout": {"engine": "vllm", "n": 4, "tensor_parallel": 4},
        "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 8},
        "reward": {"fn": "arithmetic"},
        "run": {"save_every": 5},
        "cluster": {"nodes": 1, "gpus_per_node": 8},
    }


def test_distributed_optimizer_is_refused_with_key_line_and_fix(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(recipe(distributed_optimizer=True), sort_keys=False))
    with pytest.raises(RecipeError) as info:
        validate_recipe(f)
    (issue,) = info.value.issues
    line = next(i for i, text in enumerate(f.read_text().splitlines(), 1) if "distributed_optimizer" in text)
    assert issue.key == "trainer.distributed_optimizer" and issue.where == f"{f}:{line}"
    assert (
        "cannot checkpoint a distributed optimizer" in issue.message and "run.save_every=5" in issue.message
    )
    assert issue.fix is not None and issue.fix.startswith("set trainer.distributed_optimizer: false")
    assert validate_recipe(f, ["trainer.distributed_optimizer=false"]).recipe.trainer.parallel.expert == 8


def test_a_trainer_that_cannot_save_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    trainer = SimpleNamespace(checkpoint_support=lambda: "trainer.distributed_optimizer: not implemented")
    session = SimpleNamespace(started_trainer=lambda: trainer)
    with pytest.raises(RlbridgeError, match="could not write checkpoints: trainer.distributed_optimizer"):
        Checkpointer(session, StopSignals(), log=lambda msg: None)  # type: ignore[arg-type]


def test_the_memory_check_never_suggests_a_refused_layout() -> None:
    from rlbridge.recipe.checks.training import _memory_changes
    from rlbridge.recipe.schema import Recipe

    r = Recipe.model_validate({**recipe(), "run": {"save_every": 5}})
    fixes = [how for how, _ in _memory_changes(r, least_share=0.3, fits=lambda changed: True)]
    assert fixes and not any("distributed_optimizer" in how for how in fixes), fixes
