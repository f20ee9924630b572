"""PPO's critic on the megatron engine (engines/megatron/critic.py), on gloo ranks next to the policy engine:

* TP1: its values equal an independent HF computation (AutoModel's last hidden state of the same checkpoint
  at positions P-1 .. P+R-2, times the same head weights) to 1e-5 relative (float32; LoRA B starts at 0);
* TP2: values equal TP1's, and the value head's gradient is identical on both TP ranks (the hidden states
  are replicated across TP ranks without sequence parallelism) and equal to TP1's;
* one critic step trains the adapters + head only (the policy's log-probs do not move), values change;
  under full fine-tuning (lora.rank 0) the whole backbone trains;
* TrainerRole at data parallel 2 takes the same critic step as at 1;
* a bfloat16 model keeps a float32 value head;
* its checkpoint: restored at TP1 it repeats its next step bit for bit, and the TP1 checkpoint resumed at TP2
  takes TP1's next step (values within 1e-5, moments within RESUME_TOL_MOMENTS, adapters within RESUME_TOL_WEIGHTS;
  riding on the TP1 and TP2 launches).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_reference import rel, seq_batch

pytestmark = pytest.mark.integration

TOL = 1e-5
RESUME_TOL_WEIGHTS = 2e-4
"""The critic's adapters after a step taken at TP2 from a TP1 checkpoint vs the step taken at TP1 (each tensor's
max |gap| / max |value|): measured 1.3e-5 on an Intel CPU (2026-12-05) and 5.5e-5 on an AMD EPYC (2026-12-06; there
in a LoRA B, linear_out). LoRA B after two Adam steps is ~2 lr in every entry, and Adam's near-sign update of an
entry with a gradient near eps turns a summation-order difference of the gradient into a larger one of the
weight; the CPU's matmul kernels decide the order. ~4x headroom over the larger."""
RESUME_TOL_MOMENTS = 1e-4
"""The same for Adam's moments: 1.2e-6 (Intel), 3.3e-5 (AMD EPYC, the value head's bias exp_avg: that gradient is a
sum over every response position with cancellation, so its summation order shows). Values and the grad norm stay
within TOL (6.1e-7 / 4.2e-7 and 1.8e-7 / 4.6e-8)."""


@pytest.fixture(scope="module")
def critic_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the TP1 launch checkpoints its critic after step 1 (the TP2 launch resumes it)."""
    return str(tmp_path_factory.mktemp("critic_ckpt"))


@pytest.fixture(scope="module")
def critic_tp1(tiny_dirs: dict[str, str], run_workers: Any, critic_ckpt: str) -> dict[str, Any]:
    return run_workers("critic_suite", 1, qwen=tiny_dirs["qwen2"], ckpt_out=critic_ckpt)[0]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


def _step2_gaps(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    gaps = {"values": _gap(got["values"], want["values"])}
    gaps["grad_norm"] = abs(got["metrics"]["critic_grad_norm"] / want["metrics"]["critic_grad_norm"] - 1)
    for group in ("trainable", "optimizer"):
        assert got["state"][group].keys() == want["state"][group].keys()
        each = {k: _gap(got["state"][group][k], t) for k, t in want["state"][group].items()}
        worst = max(each, key=lambda k: each[k])
        print(f"{group}: largest gap {each[worst]:.2e} in {worst}")
        gaps[group] = each[worst]
    return gaps


def test_critic_checkpoint_resumes_exactly(critic_tp1: dict[str, Any]) -> None:
    """The critic's checkpoint (adapters, value head, Adam moments; written but not loaded by any test before):
    restored, it takes the step it took without the checkpoint, bit for bit (same layout)."""
    gaps = _step2_gaps(critic_tp1["resumed2"], critic_tp1["step2"])
    assert any(".adapter." in k for k in critic_tp1["step2"]["state"]["trainable"])
    assert {"output_layer.weight", "output_layer.bias"} <= critic_tp1["step2"]["state"]["trainable"].keys()
    assert all(v == 0.0 for v in gaps.values()), gaps


@torch.no_grad()
def hf_values(model_dir: str, res: dict[str, Any]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = seq_batch(res["batch"])
    out = torch.zeros(batch.size, batch.response_width)
    for i in range(batch.size):  # one unpadded row at a time: nothing of the megatron-side masking is reused
        ids = batch.input_ids[i][batch.attention_mask[i] > 0]
        n_resp = int(batch.response_mask[i].sum())
        n_prompt = len(ids) - n_resp
        hidden = model(input_ids=ids[None]).last_hidden_state[0].double()
        v = hidden[n_prompt - 1 : n_prompt + n_resp - 1] @ res["weight"].double().T + res["bias"].double()
        out[i, :n_resp] = v.squeeze(-1).float()
    return out


def test_values_match_hf_hidden_states_times_the_head(
    critic_tp1: dict[str, Any], tiny_dirs: dict[str, str]
) -> None:
    want = hf_values(tiny_dirs["qwen2"], critic_tp1)
    got = critic_tp1["values"]
    mask = seq_batch(critic_tp1["batch"]).response_mask > 0
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got[~mask] == 0).all()
    err = rel(got[mask], want[mask])
    print(f"megatron critic vs HF values: rel error {err:.2e}")
    assert err < TOL


def test_full_fine_tuning_critic(tiny_dirs: dict[str, str], run_workers: Any) -> None:
    """lora.rank 0: the whole backbone and the head train; values still equal the HF computation first."""
    res = run_workers("critic_suite", 1, qwen=tiny_dirs["qwen2"], rank=0)[0]
    mask = seq_batch(res["batch"]).response_mask > 0
    assert rel(res["values"][mask], hf_values(tiny_dirs["qwen2"], res)[mask]) < TOL
    assert not any(".adapter." in n for n in res["trainable"]) and len(res["trainable"]) > 20
    assert res["metrics"]["critic_grad_norm"] > 0 and res["metrics"]["critic_skipped"] == 0
    torch.testing.assert_close(res["policy_after"], res["policy_before"], rtol=0, atol=0)


def test_critic_step_trains_adapters_and_head_only(critic_tp1: dict[str, Any]) -> None:
    m = critic_tp1["metrics"]
    assert m["critic_skipped"] == 0 and m["critic_grad_norm"] > 0 and m["vf_loss"] > 0, m
    assert set(critic_tp1["head_grads"]) == {"output_layer.weight", "output_layer.bias"}
    names = critic_tp1["trainable"]
    assert {"output_layer.weight", "output_layer.bias"} < set(names)
    assert all(".adapter." in n or n.startswith("output_layer.") for n in names), names
    assert not torch.equal(critic_tp1["values_after"], critic_tp1["values"])
    torch.testing.assert_close(critic_tp1["policy_after"], critic_tp1["policy_before"], rtol=0, atol=0)


def test_tp2_equals_tp1_and_head_gradients_agree(
    critic_tp1: dict[str, Any], tiny_dirs: dict[str, str], run_workers: Any, critic_ckpt: str
) -> None:
    """Also: the TP1 critic checkpoint resumed at TP2 takes TP1's step 2: values and grad norm within 1e-5 relative,
    Adam's moments within RESUME_TOL_MOMENTS, the adapters and head within RESUME_TOL_WEIGHTS (the gaps and the
    tensors that have them are printed)."""
    ranks = run_workers("critic_suite", 2, timeout=150, qwen=tiny_dirs["qwen2"], tp=2, ckpt_in=critic_ckpt)
    gaps = _step2_gaps(ranks[0]["resumed2"], critic_tp1["step2"])
    print(f"critic TP1 save -> TP2 resume, step 2, max relative gap: {gaps}")
    assert gaps.pop("trainable") <= RESUME_TOL_WEIGHTS, gaps
    assert gaps.pop("optimizer") <= RESUME_TOL_MOMENTS, gaps
    assert all(v <= 1e-5 for v in gaps.values()), gaps
    mask = seq_batch(critic_tp1["batch"]).response_mask > 0
    for res in ranks:
        err = rel(res["values"][mask], critic_tp1["values"][mask])
        print(f"TP2 vs TP1 values: rel error {err:.2e}")
        assert err < TOL
        for name, grad in critic_tp1["head_grads"].items():
            assert rel(res["head_grads"][name], grad) < 1e-4, name
        assert res["metrics"]["critic_grad_norm"] == pytest.approx(
            critic_tp1["metrics"]["critic_grad_norm"], rel=1e-4
        )
    for name in critic_tp1[
        "head_grads"
    ]:  # replicated hidden states: the very same head gradient on each TP rank
        assert torch.equal(ranks[0]["head_grads"][name], ranks[1]["head_grads"][name]), name
    torch.testing.assert_close(ranks[0]["values_after"], ranks[1]["values_after"], rtol=0, atol=0)


def test_ppo_role_update_data_parallel_2_equals_1(tiny_dirs: dict[str, str], run_workers: Any) -> None:
    """TrainerRole's data-parallel contract for the critic: value shares in dp order make up the full batch's
    values, and two replicas take the same critic steps as one (the value loss closure maps shard rows to
    mini-batch rows and undoes DDP's average, as the policy's does)."""
    one = run_workers("role_ppo_update_suite", 1, qwen=tiny_dirs["qwen2"])[0]
    two = run_workers("role_ppo_update_suite", 2, timeout=150, qwen=tiny_dirs["qwen2"])
    assert one["dp"] == 1 and [r["dp"] for r in two] == [2, 2]
    torch.testing.assert_close(torch.cat([r["values_share"] for r in two]), one["values"])
    m1, m2 = one["metrics"], two[0]["metrics"]
    assert m1["critic_grad_norm"] > 0 and m1["critic_skipped"] == 0
    assert abs(m1["critic_grad_norm"] - m2["critic_grad_norm"]) < 1e-5 * m1["critic_grad_norm"], (m1, m2)
    for name, tensor in one[
        "critic_after"
    ].items():  # two Adam steps of lr 1e-2: float32 summation order only
        for r in two:
            torch.testing.assert_close(r["critic_after"][name], tensor, rtol=1e-4, atol=1e-5)


def test_bfloat16_model_keeps_a_float32_head(
    critic_tp1: dict[str, Any], tiny_dirs: dict[str, str], run_workers: Any
) -> None:
    """model.dtype bfloat16: megatron's Float16Module casts the whole model, the value head stays float32 (and
    megatron's mixed-precision optimizer steps it as an fp32 parameter); values within bf16 noise of float32's."""
    res = run_workers("critic_suite", 1, qwen=tiny_dirs["qwen2"], dtype="bfloat16")[0]
    assert res["dtypes"]["output_layer.weight"] == res["dtypes"]["output_layer.bias"] == "torch.float32"
    assert all(d == "torch.bfloat16" for n, d in res["dtypes"].items() if ".adapter." in n)
    assert res["values"].dtype == torch.float32
    mask = seq_batch(res["batch"]).response_mask > 0
    err = rel(res["values"][mask], critic_tp1["values"][mask])
    print(f"bfloat16 vs float32 critic values: rel error {err:.2e}")
    assert err < 5e-2
    assert res["metrics"]["critic_skipped"] == 0 and res["metrics"]["critic_grad_norm"] > 0
