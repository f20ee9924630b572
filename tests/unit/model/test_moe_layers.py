"""MoE models with dense layers among the MoE ones (DeepSeek's / GLM's first_k_dense_replace, Qwen-MoE's
mlp_only_layers and decoder_sparse_step): the model facts, the plan's parameter counts against transformers'
own models (built on the meta device: exact integer counts), and validation's refusal of routing replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlbridge.errors import RecipeError
from rlbridge.model.info import SHORT_NAMES, ModelInfo, dense_layer_count
from rlbridge.plan import lora_params
from rlbridge.recipe import validate_recipe
from rlbridge.recipe.schema import Recipe

TINY = dict(SHORT_NAMES["tiny-qwen3-moe-smoke"])


@pytest.mark.parametrize(
    ("keys", "dense"),
    [
        ({}, 0),  # Mixtral, the Qwen3-MoE releases: every layer MoE
        ({"mlp_only_layers": [0, 3]}, 2),
        ({"decoder_sparse_step": 2}, 3),  # layers 1, 3, 5 MoE
        ({"first_k_dense_replace": 1}, 1),  # DeepSeek V2 / V3, GLM-4.5, Kimi
        (
            {"first_k_dense_replace": 1, "moe_layer_freq": 2},
            4,
        ),  # DeepSeek's own code: i >= k and i % freq == 0
    ],
)
def test_dense_layer_count(keys: dict[str, Any], dense: int) -> None:
    assert dense_layer_count(keys, 6) == dense


def _hf_params(cfg: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, the MLP parameters of the MoE blocks and dense MLPs) of transformers' own model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    mlp = sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)
    return total, mlp


def test_mlp_parameter_counts_match_transformers_for_a_mixed_model() -> None:
    """The plan's MLP parameters (ModelInfo.mlp_params / dense_mlp_params by layer kind) equal the transformers
    model's exactly, with 2 of 4 layers dense; the whole-model totals differ only by what ModelInfo leaves
    approximate (q/k norms), identically for the all-MoE and the mixed model."""
    cfg = {**TINY, "num_hidden_layers": 4}
    mixed = {**cfg, "mlp_only_layers": [0, 2]}
    for c in (cfg, mixed):
        m = ModelInfo.from_config(c)
        total, mlp = _hf_params(c)
        assert m.moe_layers * m.mlp_params() + m.dense_layers * m.dense_mlp_params() == mlp
        assert m.total_params() - total == ModelInfo.from_config(cfg).total_params() - _hf_params(cfg)[0]
    assert ModelInfo.from_config(mixed).dense_layers == 2


def test_lora_parameters_count_one_adapter_per_expert_on_moe_layers_and_one_on_dense_layers() -> None:
    """Megatron's LoRA shapes (fc1 = gate and up fused, one adapter per local expert), written out by hand for
    the tiny model with 2 MoE and 2 dense layers: hidden 128, 4 heads + 2 x 2 KV heads of 32, experts 4 x 64
    wide, dense MLP 256 wide, rank 4."""
    c = {**TINY, "num_hidden_layers": 4, "mlp_only_layers": [0, 2]}
    r = Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": "x"},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}},
            "lora": {
                "rank": 4,
                "alpha": 8,
                "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            },
        }
    )
    m = ModelInfo.from_config(c)
    assert (m.hidden, m.heads, m.kv_heads, m.head_dim, m.moe_intermediate, m.intermediate) == (
        128,
        4,
        2,
        32,
        64,
        256,
    )
    attention = 4 * (128 + 8 * 32) + 4 * (4 * 32 + 128)  # qkv, proj
    expert = 4 * (128 + 2 * 64) + 4 * (64 + 128)  # fc1, fc2
    dense = 4 * (128 + 2 * 256) + 4 * (256 + 128)
    assert lora_params(r, m) == 4 * attention + 2 * 4 * expert + 2 * dense


def test_routing_replay_is_refused_for_a_model_with_dense_layers(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    cfg = yaml.safe_load(
        (Path(__file__).parents[2] / "fixtures/configs/qwen3-30b-a3b/config.json").read_text()
    )
    (model / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [0]}))
    recipe = {
        "name": "t",
        "model": {"path": str(model), "dtype": "bfloat16"},
        "trainer": {"engine": "hf", "micro_batch_size": 1},
        "rollout": {
            "engine": "vllm",
            "routing_replay": True,
            "max_prompt_tokens": 64,
            "max_response_tokens": 64,
        },
        "reward": {"fn": "arithmetic"},
        "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 8},
        "cluster": {"device": "cuda", "gpus_per_node": 1, "gpu_memory_gib": 139},
    }
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError) as e:
        validate_recipe(f, [])
    issue = next(i for i in e.value.issues if i.key == "rollout.routing_replay")
    assert "1 dense layers among its 48" in issue.message and issue.fix == "set rollout.routing_replay: false"
    f.write_text(yaml.safe_dump({**recipe, "rollout": {**recipe["rollout"], "routing_replay": False}}))
    issues = []
    try:
        validate_recipe(f, [])
    except RecipeError as err:
        issues = [i.key for i in err.issues]
    assert "rollout.routing_replay" not in issues
