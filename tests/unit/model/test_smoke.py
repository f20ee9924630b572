"""`rlbridge train --smoke`: the shrunk model keeps the architecture and divides the recipe's layout, the
overrides turn the recipe into a valid CPU run, and every CPU-only setting is turned off with a note."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbridge.errors import RlbridgeError
from rlbridge.model.info import ModelInfo
from rlbridge.model.smoke import HEAD_DIM, plan_smoke, read_config
from rlbridge.recipe import load_recipe, validate_recipe
from rlbridge.recipe.checks import check_model_shape

ROOT = Path(__file__).resolve().parents[3]
CASES = {
    "qwen2.5-7b-grpo-lora.yaml": "tests/fixtures/configs/qwen2.5-7b-instruct",
    "qwen3-30b-a3b-moe-lora.yaml": "tests/fixtures/configs/qwen3-30b-a3b",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_smoke_plan_keeps_the_layout_and_validates(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(ROOT)
    recipe_file = ROOT / "recipes" / name
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    base = [f"model.path={CASES[name]}", f"data.train.path={data}", f"data.val.path={data}"]
    original = load_recipe(recipe_file, base)
    config = read_config(original)
    plan = plan_smoke(original, config)
    c, p = plan.config, original.trainer.parallel
    assert c["model_type"] == config["model_type"] and c["architectures"] == config["architectures"]
    assert (
        c["num_hidden_layers"] % (p.pipeline * (p.virtual_pipeline or 1)) == 0 and c["num_hidden_layers"] >= 2
    )
    assert c["num_attention_heads"] % p.tensor == 0 and c["num_key_value_heads"] % p.tensor == 0
    assert c["num_attention_heads"] > c["num_key_value_heads"]  # grouped-query attention kept
    assert c["hidden_size"] == c["num_attention_heads"] * HEAD_DIM
    if "num_experts" in config:
        assert c["num_experts"] % p.expert == 0 and c["num_experts_per_tok"] <= c["num_experts"]
    smoke = validate_recipe(recipe_file, [*base, *plan.overrides], model_checks=False).recipe
    issues: list = []
    check_model_shape(smoke, ModelInfo.from_config(c), issues)
    assert not issues, issues
    assert (
        smoke.cluster.device == "cpu" and smoke.world_size == original.world_size and smoke.cluster.nodes == 1
    )
    assert smoke.trainer.parallel.tensor == p.tensor and smoke.trainer.parallel.pipeline == p.pipeline
    assert smoke.trainer.parallel.expert == p.expert and smoke.lora == original.lora
    assert smoke.trainer.recompute == original.trainer.recompute and smoke.run.steps == 2
    assert not smoke.trainer.parallel.sequence_parallel and not smoke.trainer.distributed_optimizer
    assert smoke.rollout.engine == "hf" and smoke.model.dtype == "float32"
    assert [t.fn for t in smoke.reward.resolved_terms()] == ["gsm8k", "length"]
    notes = " ".join(plan.notes)
    if p.sequence_parallel:
        assert "sequence_parallel turned off" in notes
    if original.trainer.distributed_optimizer:
        assert "distributed_optimizer turned off" in notes


def test_smoke_is_for_megatron_recipes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    with pytest.raises(RlbridgeError, match="megatron recipes"):
        plan_smoke(recipe, read_config(recipe))
