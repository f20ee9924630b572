"""Megatron checkpoints without Megatron (issue 15): which layout changes a resume accepts, the renaming of
canonical adapters for export-hf, against a hand-made Megatron-Bridge layout, and checkpoints that do not fit
(unknown or missing tensors, another recipe) refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.engines.megatron.hf_names import lora_to_peft
from rlbridge.errors import RlbridgeError
from rlbridge.run import resume_policy as policy

OLD = "trainer: {engine: megatron, parallel: {tensor: 2, pipeline: 2}}\ncluster: {gpus_per_node: 4}\n"
NEW = "trainer: {engine: megatron, parallel: {tensor: 1, pipeline: 1}}\ncluster: {gpus_per_node: 1}\n"


def test_layout_change_needs_a_layout_free_checkpoint() -> None:
    refused = policy.check_resume_compatible(OLD, NEW)
    assert len(refused) == 3 and refused[0].startswith("trainer.parallel.tensor changed from 2 to 1")
    assert "only a layout-free checkpoint" in refused[0]
    assert policy.check_resume_compatible(OLD, NEW, layout_free=True) == []
    other_model = NEW.replace("engine: megatron", "engine: hf")  # not a layout change: still refused
    assert [
        p.split(" changed")[0] for p in policy.check_resume_compatible(OLD, other_model, layout_free=True)
    ] == ["trainer.engine"]


CONFIG = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 16,
}  # head_dim 4, 2 heads a group


def test_lora_to_peft_splits_fused_projections() -> None:
    rank, hd = 2, 4
    rows = torch.arange((4 + 2 * 2) * hd, dtype=torch.float32)[:, None].expand(-1, rank)  # row index as value
    fc1 = torch.arange(2 * 6, dtype=torch.float32)[:, None].expand(-1, rank)
    a = torch.randn(rank, 16)
    out = lora_to_peft(
        {
            "decoder.layers.1.self_attention.linear_qkv.adapter.linear_in.weight": a,
            "decoder.layers.1.self_attention.linear_qkv.adapter.linear_out.weight": rows,
            "decoder.layers.1.mlp.linear_fc1.adapter.linear_out.weight": fc1,
            "decoder.layers.1.self_attention.linear_proj.adapter.linear_in.weight": a,
        },
        CONFIG,
    )
    p = "base_model.model.model.layers.1."
    # megatron's qkv rows per key/value group: [q head 0, q head 1, k, v] x 2 groups, 4 rows each
    assert out[p + "self_attn.q_proj.lora_B.default.weight"][:, 0].tolist() == [*range(0, 8), *range(16, 24)]
    assert out[p + "self_attn.k_proj.lora_B.default.weight"][:, 0].tolist() == [*range(8, 12), *range(24, 28)]
    assert out[p + "self_attn.v_proj.lora_B.default.weight"][:, 0].tolist() == [
        *range(12, 16),
        *range(28, 32),
    ]
    assert all(torch.equal(out[p + f"self_attn.{x}_proj.lora_A.default.weight"], a) for x in "qkv")
    assert out[p + "mlp.gate_proj.lora_B.default.weight"][:, 0].tolist() == list(range(6))
    assert out[p + "mlp.up_proj.lora_B.default.weight"][:, 0].tolist() == list(range(6, 12))
    assert torch.equal(out[p + "self_attn.o_proj.lora_A.default.weight"], a)


def test_lora_to_peft_refuses_another_model() -> None:
    with pytest.raises(RlbridgeError, match="linear_qkv.adapter.linear_out.weight: 8 rows, expected 32"):
        lora_to_peft(
            {"decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight": torch.zeros(8, 2)},
            CONFIG,
        )
    with pytest.raises(RlbridgeError, match="'output_layer.weight' is not a LoRA adapter"):
        lora_to_peft({"output_layer.weight": torch.zeros(8, 2)}, CONFIG)


# ------------------------------------------------------------------------------------- bad checkpoints
NAMES = {
    "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight",
    "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.adapter.linear_out.weight",
    "output_layer.weight",
}
"""The trainable tensors of a model, of every rank (engines/megatron/state.py `_world_names`)."""


def _full(names: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    tensors = {n: torch.zeros(2) for n in names}
    moments = {f"{n}:{k}": torch.zeros(2) for n in names for k in ("exp_avg", "exp_avg_sq", "step")}
    return tensors, moments


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t, m: t.update({"embedding.word_embeddings.weight": torch.zeros(2)}), "does not train"),
        (
            lambda t, m: t.update({"decoder.layers.1.mlp.experts.local_experts.9.linear_fc1.weight": 0}),
            "not train",
        ),
        (lambda t, m: t.pop("output_layer.weight"), "lacks 1 trainable"),
        (
            lambda t, m: m.update({"embedding.word_embeddings.weight:exp_avg": torch.zeros(2)}),
            "for no trainable",
        ),
        (lambda t, m: m.update({"output_layer.weight:momentum": torch.zeros(2)}), "for no trainable"),
        (lambda t, m: m.pop("output_layer.weight:exp_avg_sq"), "part of Adam's state"),
    ],
    ids=["unknown-no-layer", "unknown-expert", "missing", "stray-moment", "unknown-key", "partial-adam"],
)
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_naming_the_tensor(
    change: Any, message: str
) -> None:
    """Any tensor the model lacks is refused with its name (a name without a layer number too), as is one the
    model has but the checkpoint lacks and optimizer state for no tensor; a fitting one passes."""
    from rlbridge.engines.megatron.state import check_names

    tensors, moments = _full(NAMES)
    check_names(tensors, moments, NAMES, "the policy")
    before = (set(tensors), set(moments))
    change(tensors, moments)
    named = (set(tensors) ^ before[0]) | (set(moments) ^ before[1])
    with pytest.raises(RlbridgeError, match=message) as info:
        check_names(tensors, moments, NAMES, "the policy")
    (name,) = named
    assert name.split(":")[0] in str(info.value) and str(info.value).startswith("the policy: ")


class _PortableEngine:
    """The checkpoint surface of a layout-free engine (PortableCheckpointEngine), in one process."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] = {}

    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        return {"trainable": {"w": torch.ones(2)}, "optimizer": {}}, {"format": "test"}

    def load_checkpoint_state(self, groups: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> None:
        self.loaded = groups


def _role(tmp_path: Path, **over: Any) -> Any:
    from rlbridge.recipe.schema import Recipe
    from rlbridge.trainer.role import TrainerRole

    raw: dict[str, Any] = {
        "name": "t",
        "model": {"path": str(tmp_path / "model-a"), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8},
        "trainer": {"engine": "megatron"},
        "reward": {"fn": "arithmetic"},
        "data": {"train": {"path": "unused.jsonl"}},
        "run": {"seed": 3, "steps": 10},
    }
    for dotted, value in over.items():
        node = raw
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return TrainerRole(Recipe.model_validate(raw), str(tmp_path), engine_factory=_PortableEngine)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model.path", "/models/another"),
        ("lora.rank", 8),
        ("algorithm.name", "dapo"),
        ("run.seed", 4),
        ("trainer.parallel.context", 2),
    ],
)
def test_a_checkpoint_of_another_recipe_is_refused_naming_the_key(
    tmp_path: Path, key: str, value: Any
) -> None:
    """The trainer compares the checkpoint's recipe with its own before loading a tensor (resume_policy: what may
    change on resume); a layout key of a layout-free checkpoint may change."""
    from rlbridge.run.directory import resolved_yaml

    saver = _role(tmp_path)
    saved = saver.save_checkpoint(str(tmp_path / "run"), 2, {}, resolved_yaml(saver.recipe), keep=1)
    layout = _role(tmp_path, **{"trainer.parallel.tensor": 2, "run.steps": 20})
    layout.load_checkpoint(saved.path)
    assert torch.equal(layout.engine.loaded["trainable"]["w"], torch.ones(2))
    other = _role(tmp_path, **{key: value})
    with pytest.raises(RlbridgeError, match="is not of this run's recipe: ") as info:
        other.load_checkpoint(saved.path)
    assert f"; {key} changed from" in f"; {str(info.value).split('recipe: ', 1)[1]}"
    assert f"Set {key} back to" in str(info.value) and other.engine.loaded == {}
