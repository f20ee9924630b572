"""The megatron engine's micro-batches without compute on padding (issue 16; engines/micro.py): at PP = CP = 1
rows are grouped by length and each micro-batch runs at its rows' own widths, against the former index-order
micro-batches at the whole batch's width, on the tiny Qwen2 (TP1, CPU, float32).

The batch has prompts of 1..14 and responses of 1..17 tokens, so trimming drops most columns of the short
groups. megatron's RoPE counts positions 0..S-1 of the (trimmed) row, which moves every position of a row by
the same offset: q-k distances, hence the scores, are unchanged. Only float summation order differs.
Tolerances: log-probs atol 1e-5; first-step gradients of a grouping-invariant loss (each micro-batch's share
of the batch loss, as rlbridge.algo.objective's closures) within 1e-5 relative Frobenius error and 1e-5 of
the tensor's largest entry elementwise, per trainable tensor (LoRA and full fine-tuning; PPO's critic under
LoRA: values atol 1e-5, gradients of its value loss as the policy's).

A token budget (trainer.max_tokens_per_micro_batch 48: 5 training passes where micro_batch_size gives 3, so
megatron's schedule divides each pass's loss by 5, not 3) is held to the same tolerances against the same
index-order layout; log-probs and values keep their logprob_chunk_size passes under a budget when it is set, as the hf engine's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.engines.micro import budget_rows
from tests.fixtures.spread import spread_lists

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def suite(tiny_dirs: dict[str, str], run_workers: Any) -> dict[str, Any]:
    return run_workers("padding_free_suite", 1, qwen=tiny_dirs["qwen2"])[0]


def _grad_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Worst relative Frobenius error and worst elementwise error relative to the tensor's largest entry."""
    assert got.keys() == want.keys() and got
    frob = worst = 0.0
    for name, g in got.items():
        w = want[name].double()
        assert float(w.abs().max()) > 0, name
        frob = max(frob, float((g.double() - w).norm() / w.norm()))
        worst = max(worst, float((g.double() - w).abs().max() / w.abs().max()))
    return frob, worst


def test_micro_batches_are_grouped_by_length_and_trimmed(suite: dict[str, Any]) -> None:
    width = int(suite["batch"]["input_ids"].shape[1])
    for label in ("lora", "full"):
        padded, trimmed = suite[f"{label}_padded_rows"], suite[f"{label}_trimmed_rows"]
        assert padded == [[0, 1, 2], [3, 4, 5], [6, 7]]  # the former layout: index order
        assert [len(r) for r in trimmed] == [3, 3, 2] and sorted(sum(trimmed, [])) == list(range(8))
        assert trimmed != padded
        assert suite[f"{label}_padded_widths"] == [width] * 3
        widths = suite[f"{label}_trimmed_widths"]
        assert max(widths) < width and widths[0] == 16 < 0.6 * width  # the short responses: 14 + 2 columns
        positions = sum(len(r) * w for r, w in zip(trimmed, widths, strict=True))
        assert positions < 0.7 * 8 * width, (positions, 8 * width)


@pytest.mark.parametrize("label", ["lora", "full"])
def test_logprobs_and_gradients_match_the_padded_micro_batches(suite: dict[str, Any], label: str) -> None:
    mask = suite["batch"]["response_mask"]
    got, want = suite[f"{label}_trimmed_logprobs"], suite[f"{label}_padded_logprobs"]
    assert got.shape == want.shape == mask.shape and bool((got[mask == 0] == 0).all())
    print(f"{label}: log-probs max abs difference {float((got - want).abs().max()):.2e}")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    frob, worst = _grad_errors(suite[f"{label}_trimmed_grads"], suite[f"{label}_padded_grads"])
    print(f"{label}: gradients rel. Frobenius {frob:.2e}, elementwise {worst:.2e}")
    assert frob < 1e-5 and worst < 1e-5, (frob, worst)


def test_critic_values_and_gradients_match_the_padded_micro_batches(suite: dict[str, Any]) -> None:
    mask = suite["batch"]["response_mask"]
    got, want = suite["critic_trimmed_values"], suite["critic_padded_values"]
    assert bool((got[mask == 0] == 0).all()) and float(want.abs().max()) > 0
    print(f"critic: values max abs difference {float((got - want).abs().max()):.2e}")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    frob, worst = _grad_errors(suite["critic_trimmed_grads"], suite["critic_padded_grads"])
    print(f"critic: gradients rel. Frobenius {frob:.2e}, elementwise {worst:.2e}")
    assert frob < 1e-5 and worst < 1e-5, (frob, worst)


def _budget_groups() -> list[list[int]]:
    batch = SeqBatch.from_token_lists(*spread_lists(), pad_id=0)
    return [g.tolist() for g in budget_rows(batch, 48)]


def test_token_budget_forms_the_hf_engines_passes(suite: dict[str, Any]) -> None:
    groups = _budget_groups()
    assert len(groups) == 5  # not micro_batch_size's 3: the schedule's num_microbatches changes
    for label in ("lora", "full", "critic"):
        assert suite[f"{label}_budget_rows"] == groups, label
    widths = [w for label in ("lora", "full") for w in suite[f"{label}_budget_widths"]]
    assert widths == [16, 6, 18, 25, 18] * 2  # each pass at its own rows' widths


def _assert_matches_padded(suite: dict[str, Any], label: str, layout: str) -> None:
    """The `layout` results of `label` (lora, full: log-probs; critic: values) against the index-order layout at
    the batch's width: atol 1e-5, gradients within 1e-5 (relative Frobenius and elementwise)."""
    kind = "values" if label == "critic" else "logprobs"
    got, want = suite[f"{label}_{layout}_{kind}"], suite[f"{label}_padded_{kind}"]
    print(f"{label} {layout}: {kind} max abs difference {float((got - want).abs().max()):.2e}")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    frob, worst = _grad_errors(suite[f"{label}_{layout}_grads"], suite[f"{label}_padded_grads"])
    print(f"{label} {layout}: gradients rel. Frobenius {frob:.2e}, elementwise {worst:.2e}")
    assert frob < 1e-5 and worst < 1e-5, (frob, worst)


@pytest.mark.parametrize("label", ["lora", "full"])
def test_token_budget_logprobs_and_gradients_match_the_padded_micro_batches(
    suite: dict[str, Any], label: str
) -> None:
    _assert_matches_padded(suite, label, "budget")


def test_token_budget_critic_values_and_gradients_match_the_padded_micro_batches(
    suite: dict[str, Any],
) -> None:
    _assert_matches_padded(suite, "critic", "budget")


@pytest.mark.parametrize("label", ["lora", "full", "critic"])
def test_rounded_pass_widths_match_the_padded_micro_batches(suite: dict[str, Any], label: str) -> None:
    """trainer.pass_width_multiple 16 over the token budget's passes: each pass right-padded (masked) to 16 or 32
    columns (from 16, 6, 18, 25, 18), the same log-probs / values and gradients as the index-order layout at the
    batch's width (the tolerances above)."""
    assert suite[f"{label}_rounded_widths"] == [16, 16, 32, 32, 32]
    _assert_matches_padded(suite, label, "rounded")


@pytest.mark.parametrize("label", ["lora", "full"])
def test_output_layer_on_response_positions_only_changes_nothing(suite: dict[str, Any], label: str) -> None:
    """forward.response_head: the output layer runs on the R positions that predict response tokens, not on all
    P + R; log-probs and gradients as with logits at every position (atol 1e-6; gradients 1e-6 relative)."""
    batch = suite["batch"]
    width, response = int(batch["input_ids"].shape[1]), int(batch["response_mask"].shape[1])
    assert suite[f"{label}_response_head_lengths"] == [response]
    assert suite[f"{label}_every_position_head_lengths"] == [width]
    got, want = suite[f"{label}_response_head_logprobs"], suite[f"{label}_every_position_head_logprobs"]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    frob, worst = _grad_errors(
        suite[f"{label}_response_head_grads"], suite[f"{label}_every_position_head_grads"]
    )
    print(
        f"{label}: response-only head vs every position: gradients rel. Frobenius {frob:.2e}, elementwise {worst:.2e}"
    )
    assert frob < 1e-6 and worst < 1e-6, (frob, worst)
