"""Megatron checkpoints without Megatron (issue 15): which layout changes a resume accepts, and the renaming
of canonical adapters for export-hf, against a hand-made Megatron-Bridge layout."""

from __future__ import annotations

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
