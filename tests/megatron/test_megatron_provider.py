"""The recipe -> provider mapping table (USER_REPORTS A, R1): no construction-relevant field goes unmapped,
and every row really lands on the provider / DDP config / optimizer config / PEFT object."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from rlbridge.engines.megatron.provider import NOT_IN_TABLE, TABLE, recipe_value
from rlbridge.recipe.schema import LoraCfg, ModelCfg, OptimCfg, ParallelCfg, Recipe, RecomputeCfg, TrainerCfg

WALKED_SECTIONS: dict[str, type[BaseModel]] = {
    "trainer.parallel": ParallelCfg,
    "trainer.recompute": RecomputeCfg,
    "trainer.optim": OptimCfg,
    "model": ModelCfg,
    "lora": LoraCfg,
}


def schema_keys() -> list[str]:
    keys = [
        f"{prefix}.{name}" for prefix, section in WALKED_SECTIONS.items() for name in section.model_fields
    ]
    for name, info in TrainerCfg.model_fields.items():
        nested = isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
        if nested:
            assert f"trainer.{name}" in WALKED_SECTIONS, (
                f"new TrainerCfg section trainer.{name}: walk it here"
            )
        else:
            keys.append(f"trainer.{name}")
    return keys


def test_every_construction_field_is_mapped_or_excused() -> None:
    table_keys = {row.key for row in TABLE}
    unmapped = [k for k in schema_keys() if k not in table_keys and k not in NOT_IN_TABLE]
    assert not unmapped, f"recipe fields neither in provider.TABLE nor in NOT_IN_TABLE: {unmapped}"
    assert not table_keys & set(NOT_IN_TABLE), "a key cannot be both mapped and excused"
    assert all(reason.strip() for reason in NOT_IN_TABLE.values())


def test_table_and_excuses_name_real_fields() -> None:
    known = set(schema_keys())
    stale = sorted({row.key for row in TABLE} - known) + sorted(set(NOT_IN_TABLE) - known)
    assert not stale, f"rows for fields the schema does not have: {stale}"
    assert all(row.target.split(".")[0] in {"provider", "ddp", "optim", "peft", "run"} for row in TABLE)


NON_DEFAULT: list[dict[str, Any]] = [
    {
        "model": {"dtype": "bfloat16"},
        "trainer": {
            "engine": "megatron",
            "parallel": {
                "tensor": 2,
                "pipeline": 2,
                "virtual_pipeline": 2,
                "context": 2,
                "expert": 2,
                "expert_tensor": 2,
                "sequence_parallel": True,
            },
            "recompute": {"granularity": "full", "method": "block", "num_layers": 2},
            "optim": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.8, 0.95], "eps": 1e-6, "clip_grad": 0.5},
            "micro_batch_size": 3,
            "distributed_optimizer": True,
            "grad_reduce_dtype": "bfloat16",
            "logprob_chunk_size": 5,
        },
        "lora": {"rank": 8, "alpha": 16.0, "dropout": 0.1, "targets": ["q_proj", "v_proj", "down_proj"]},
    },
    {
        "model": {"dtype": "float16"},
        "trainer": {
            "engine": "megatron",
            "parallel": {"tensor": 4},
            "recompute": {"granularity": "selective"},
            "optim": {"clip_grad": None},
        },
        "lora": {"rank": 4, "type": "canonical_lora", "targets": ["all-linear"]},
    },
    {"trainer": {"engine": "megatron"}, "lora": {"rank": 2, "type": "dora", "targets": ["linear_qkv"]}},
    {"trainer": {"engine": "megatron"}},
]


def _recipe(path: str, raw: dict[str, Any]) -> Recipe:
    body = {"name": "t", "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "x.jsonl"}}, **raw}
    body["model"] = {"path": path, **raw.get("model", {})}
    return Recipe.model_validate(body)


def test_non_default_recipes_cover_every_row() -> None:
    default = _recipe("/m", {})
    for row in TABLE:
        values = [recipe_value(_recipe("/x", raw), row.key) for raw in NON_DEFAULT]
        if row.key == "model.path":
            continue
        assert any(v != recipe_value(default, row.key) for v in values), f"no test recipe changes {row.key}"


@pytest.mark.integration
def test_provider_gets_every_row(tiny_dirs: dict[str, str], run_workers: Any) -> None:
    result = run_workers("provider_rows", 1, model_dir=tiny_dirs["qwen2"], recipes=NON_DEFAULT)[0]
    classes = ["LoRA", "CanonicalLoRA", "DoRA", None]
    for raw, got, cls in zip(NON_DEFAULT, result["recipes"], classes, strict=True):
        wrong = [r for r in got["rows"] if not r["equal"]]
        assert not wrong, f"rows not applied for {raw}: {wrong}"
        assert got["peft_class"] == cls
        if cls is not None:  # the PEFT object carries what the table put in its settings
            assert got["peft_fields"] == got["peft_settings"]
        assert not any(got["fusions"].values()), f"fusions left on without TE: {got['fusions']}"
        assert got["layer_spec"] == "local_layer_spec" and got["cpu_init"]
    # the compat layer: TE placeholder gone after import, HAVE_TE off, versions known, mode scoped
    assert not result["te_importable"] and result["have_te_flags"] == [False, False]
    assert result["versions"]["megatron-core"] and result["versions"]["megatron-bridge"]
    assert result["cuda_type_outside_scope"] == "torch.FloatTensor"
    first = {r["target"]: r["actual"] for r in result["recipes"][0]["rows"]}
    assert first["provider.tensor_model_parallel_size"] == "2"
    assert first["provider.recompute_method"] == "'block'"
    assert first["ddp.grad_reduce_in_fp32"] == "False" and first["ddp.use_distributed_optimizer"] == "True"
    assert first["peft.target_modules"] == "['linear_qkv', 'linear_fc2']"
    second = {r["target"]: r["actual"] for r in result["recipes"][1]["rows"]}
    assert second["optim.clip_grad"] == "0.0" and second["provider.recompute_granularity"] == "'selective'"
    assert (
        second["peft.target_modules"]
        == "['linear_q', 'linear_k', 'linear_v', 'linear_proj', 'linear_fc1_gate', 'linear_fc1_up', 'linear_fc2']"
    )


@pytest.mark.integration
def test_provider_gets_the_models_rope_theta(tmp_path: Any, run_workers: Any) -> None:
    """Under transformers 5, rope_theta lives in config.rope_parameters; the provider must still get it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        rope_theta=1e6,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    got = run_workers("provider_rope", 1, model_dir=str(tmp_path / "m"))[0]
    assert got["rotary_base"] == 1e6
