"""MegatronTrainEngine at TP1/PP1 on CPU (gloo), against independent HF / peft references.

Tolerances (float32 everywhere on the megatron side): logits vs HF rel. error < 1e-5; log-probs vs a float64
HF computation max abs error < 1e-4; exported weights loaded into transformers / peft give the trainer's
logits to rel. error < 1e-4.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import load_hf, logits, peft_model, rel, response_logprobs_f64, seq_batch

pytestmark = pytest.mark.integration


def test_logits_match_hf(tp1: dict[str, Any], tiny_dirs: dict[str, str]) -> None:
    batch = seq_batch(tp1["batch_full"])
    ref = logits(load_hf(tiny_dirs["qwen2"]), batch)
    assert rel(tp1["logits_init"], ref) < 1e-5


def test_trainable_equals_optimizer_equals_grad_buffers_equals_adapters(tp1: dict[str, Any]) -> None:
    sets = tp1["sets"]
    assert sets["adapters"] and all(".adapter." in n for n in sets["adapters"])
    assert len(sets["adapters"]) == 4 * 4 * 2  # layers x (qkv, proj, fc1, fc2) x (A, B)
    for label in ("at_wrap", "trainable", "optimizer", "grad_buffers"):
        assert sets[label] == sets["adapters"], label


def test_logprobs_match_float64_hf_on_ragged_batch(tp1: dict[str, Any], tiny_dirs: dict[str, str]) -> None:
    batch = seq_batch(tp1["batch_ragged"])
    assert len(set(batch.attention_mask.sum(1).tolist())) > 1, "the batch must be ragged"
    ref = response_logprobs_f64(load_hf(tiny_dirs["qwen2"]), batch)
    got = tp1["logprobs_init"]
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert float((got.double() - ref).abs().max()) < 1e-4
    assert bool((got[batch.response_mask == 0] == 0).all())


def test_training_changes_adapters_only(tp1: dict[str, Any]) -> None:
    for step in tp1["steps"]:
        assert step["skipped"] == 0.0 and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    assert tp1["steps"][1]["loss"] < tp1["steps"][0]["loss"]
    assert tp1["changed"] and all(tp1["changed"].values())
    assert tp1["frozen_before"] == tp1["frozen_after"]


def test_reference_logprobs_are_the_base_model(tp1: dict[str, Any], tiny_dirs: dict[str, str]) -> None:
    batch = seq_batch(tp1["batch_ragged"])
    base = response_logprobs_f64(load_hf(tiny_dirs["qwen2"]), batch)
    assert float((tp1["logprobs_reference_trained"].double() - base).abs().max()) < 1e-4
    assert float((tp1["logprobs_trained"].double() - base).abs().max()) > 1e-2  # the adapters do matter


def test_merged_export_reproduces_trainer(tp1: dict[str, Any], tiny_dirs: dict[str, str]) -> None:
    reference = load_hf(tiny_dirs["qwen2"])
    assert set(tp1["merged"]) == set(reference.state_dict())  # untied: lm_head included
    merged = load_hf(tiny_dirs["qwen2"], state=tp1["merged"])
    batch = seq_batch(tp1["batch_full"])
    assert rel(logits(merged, batch), tp1["logits_trained"]) < 1e-4
    ragged = seq_batch(tp1["batch_ragged"])
    ref = response_logprobs_f64(merged, ragged)
    assert float((tp1["logprobs_trained"].double() - ref).abs().max()) < 1e-4


def test_adapter_export_loads_in_peft(tp1: dict[str, Any], tiny_dirs: dict[str, str], tmp_path: Path) -> None:
    names = list(tp1["adapter"])
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert len(names) == 4 * 7 * 2  # layers x HF projections x (A, B)
    model = peft_model(tiny_dirs["qwen2"], tp1["adapter"], tp1["adapter_config"], tmp_path / "adapter")
    batch = seq_batch(tp1["batch_full"])
    assert rel(logits(model, batch), tp1["logits_trained"]) < 1e-4


# ----------------------------------------------------------------------------------- recompute
@pytest.fixture(scope="module")
def recompute(tiny_dirs: dict[str, str], run_workers: Any) -> dict[str, Any]:
    return run_workers("recompute_suite", 1, qwen=tiny_dirs["qwen2"])[0]


@pytest.mark.parametrize("label", ["uniform", "block"])
def test_full_recompute_keeps_lora_gradients(recompute: dict[str, Any], label: str) -> None:
    """PP=1, frozen base, full recompute: adapter gradients non-zero and equal to the run without recompute
    (recompute replays the same float32 ops: rel. error < 1e-6 per tensor; bitwise equal here)."""
    assert recompute[f"{label}_fix"]
    plain, got = recompute["plain"], recompute[label]
    assert set(got) == set(plain) and len(got) == 32
    for name, grad in got.items():
        assert float(grad.abs().sum()) > 0, name
        assert rel(grad, plain[name]) < 1e-6, name


def test_without_the_recompute_fix_adapters_get_no_gradient(recompute: dict[str, Any]) -> None:
    """The failure the fix prevents (USER_REPORTS B, verl#4514): shows the test above can fail."""
    assert all(float(g.abs().sum()) == 0 for g in recompute["unfixed"].values())


# ------------------------------------------------------------------------------ tied embeddings
@pytest.fixture(scope="module")
def tied(tiny_dirs: dict[str, str], run_workers: Any) -> dict[str, Any]:
    return run_workers("tied_llama_suite", 1, llama=tiny_dirs["llama"])[0]


def test_tied_lora_export(tied: dict[str, Any], tiny_dirs: dict[str, str]) -> None:
    hf = load_hf(tiny_dirs["llama"])
    batch = seq_batch(tied["batch_full"])
    assert rel(tied["lora_logits_init"], logits(hf, batch)) < 1e-5
    assert set(hf.state_dict()) - set(tied["lora_merged"]) == {
        "lm_head.weight"
    }  # as save_pretrained writes it
    merged = load_hf(tiny_dirs["llama"], state=tied["lora_merged"])
    assert rel(logits(merged, batch), tied["lora_logits"]) < 1e-4


def test_full_finetuning_with_reference_copy(tied: dict[str, Any], tiny_dirs: dict[str, str]) -> None:
    sets = tied["full_sets"]
    assert sets["trainable"] == sets["optimizer"] == sets["grad_buffers"] == sets["adapters"] > 0
    assert tied["full_frozen"] == {}
    assert all(s["skipped"] == 0.0 for s in tied["full_steps"])
    batch, ragged = seq_batch(tied["batch_full"]), seq_batch(tied["batch_ragged"])
    merged = load_hf(tiny_dirs["llama"], state=tied["full_merged"])
    assert rel(logits(merged, batch), tied["full_logits"]) < 1e-4
    base = response_logprobs_f64(load_hf(tiny_dirs["llama"]), ragged)
    assert float((tied["full_reference"].double() - base).abs().max()) < 1e-4
    assert float((tied["full_logprobs"].double() - base).abs().max()) > 1e-2


# --------------------------------------------------------------------------------------- mbridge
MBRIDGE = {
    "qwen2_tp1": ("qwen2", 1, 1, 1),
    "qwen2_tp2pp2": ("qwen2", 2, 2, 4),
    "llama_tied_pp2": ("llama", 1, 2, 2),
}


@pytest.mark.parametrize("case", list(MBRIDGE))
def test_mbridge_full_finetuning(case: str, tiny_dirs: dict[str, str], run_workers: Any) -> None:
    arch, tp, pp, world = MBRIDGE[case]
    ranks = run_workers("mbridge_suite", world, qwen=tiny_dirs[arch], tp=tp, pp=pp)
    hf = load_hf(tiny_dirs[arch])
    for res in ranks:
        batch = seq_batch(res["batch_full"])
        assert rel(res["logits_init"], logits(hf, batch)) < 1e-5
        sets = res["sets"]
        assert (
            sets["at_wrap"]
            == sets["trainable"]
            == sets["optimizer"]
            == sets["grad_buffers"]
            == sets["adapters"]
        )
        assert all(s["skipped"] == 0.0 and s["grad_norm"] > 0 for s in res["steps"])
        assert set(res["merged"]) == set(hf.state_dict()) - ({"lm_head.weight"} if arch == "llama" else set())
        merged = load_hf(tiny_dirs[arch], state=res["merged"])
        assert rel(logits(merged, batch), res["logits"]) < 1e-4


# ------------------------------------------------------------- canonical LoRA, DoRA, non-finite step
@pytest.fixture(scope="module")
def variants(tiny_dirs: dict[str, str], run_workers: Any) -> dict[str, Any]:
    return run_workers("variants_suite", 1, qwen=tiny_dirs["qwen2"])[0]


def test_canonical_lora(variants: dict[str, Any], tiny_dirs: dict[str, str], tmp_path: Path) -> None:
    batch = seq_batch(variants["batch_full"])
    assert rel(variants["canonical_init"], logits(load_hf(tiny_dirs["qwen2"]), batch)) < 1e-5
    assert variants["canonical_num_adapters"] == 4 * 7 * 2  # separate q, k, v, gate, up adapters
    assert all(s["skipped"] == 0.0 for s in variants["canonical_steps"])
    merged = load_hf(tiny_dirs["qwen2"], state=variants["canonical_merged"])
    assert rel(logits(merged, batch), variants["canonical_logits"]) < 1e-4
    adapter, config = variants["canonical_adapter"], variants["canonical_config"]
    q_a = adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    k_a = adapter["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"]
    assert not torch.equal(q_a, k_a)  # own A per projection (plain LoRA on linear_qkv shares one)
    model = peft_model(tiny_dirs["qwen2"], adapter, config, tmp_path / "canonical")
    assert rel(logits(model, batch), variants["canonical_logits"]) < 1e-4


def test_dora_trains_and_refuses_a_wrong_export(variants: dict[str, Any], tiny_dirs: dict[str, str]) -> None:
    assert all(s["skipped"] == 0.0 and s["grad_norm"] > 0 for s in variants["dora_steps"])
    assert variants["dora_changed"] == 1.0  # every adapter tensor (A, B, magnitude) moved
    base = response_logprobs_f64(load_hf(tiny_dirs["qwen2"]), seq_batch(variants["batch_ragged"]))
    assert float((variants["dora_reference"].double() - base).abs().max()) < 1e-4
    assert float((variants["dora_logprobs"].double() - base).abs().max()) > 1e-2
    assert "DoRA" in variants["dora_export"] and "not supported" in variants["dora_export"]


def test_nonfinite_loss_skips_the_step_and_names_tensors(variants: dict[str, Any]) -> None:
    step = variants["nan_step"]
    assert step["skipped"] == 1.0 and step["nonfinite"][0] == "loss"
    assert len(step["nonfinite"]) == 1 + 32 and all(".adapter." in n for n in step["nonfinite"][1:])
    assert variants["nan_unchanged"]
    after = variants["after_nan_step"]
    assert after["skipped"] == 0.0 and math.isfinite(after["grad_norm"]) and after["grad_norm"] > 0
