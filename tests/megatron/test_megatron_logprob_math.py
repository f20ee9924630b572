"""forward.vocab_parallel_logprobs (the megatron engine's log-probs and entropies over a tensor-parallel vocabulary
shard) against float64 log-softmax on the gathered logits: two gloo ranks (TP 2), a vocabulary of 13 padded to 16
(3 padding columns on rank 1, which must get probability 0 and gradient 0). Tolerances: log-probs and entropies
1e-5 absolute, gradients 1e-5 absolute (float32 math, values of order 1-10)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ranks(run_workers: Any) -> list[dict[str, Any]]:
    return run_workers("vocab_logprob_suite", 2)


def reference(
    logits: torch.Tensor, targets: torch.Tensor, vocab: int, entropy_weight: float = 0.3
) -> dict[str, torch.Tensor]:
    full = logits.double().clone().requires_grad_(True)
    logp_all = torch.log_softmax(full[..., :vocab], dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp.sum() + entropy_weight * entropy.sum()).backward()
    assert full.grad is not None
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": full.grad}


def test_log_probs_entropies_and_gradients_match_float64(ranks: list[dict[str, Any]]) -> None:
    ref = reference(ranks[0]["logits"], ranks[0]["targets"], vocab=13)
    for r in ranks:
        torch.testing.assert_close(r["logp"].double(), ref["logp"], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["entropy"].double(), ref["entropy"], atol=1e-5, rtol=0)
        lo, hi = r["columns"]
        torch.testing.assert_close(r["grad"].double(), ref["grad"][..., lo:hi], atol=1e-5, rtol=0)
    padding = ranks[1]["grad"][..., 13 - 8 :]  # rank 1 holds columns 8..15; 13..15 are padding
    assert bool((padding == 0).all())


def test_a_metric_only_entropy_has_the_same_values_and_no_gradient(ranks: list[dict[str, Any]]) -> None:
    """entropy_grad False (algorithm.entropy_coef 0): the entropies are unchanged and the backward of the log-probs
    is that of the log-probs alone (the entropy's vocabulary-wide product is not differentiated)."""
    ref = reference(ranks[0]["logits"], ranks[0]["targets"], vocab=13, entropy_weight=0.0)
    for r in ranks:
        torch.testing.assert_close(r["entropy_metric"].double(), ref["entropy"], atol=1e-5, rtol=0)
        lo, hi = r["columns"]
        torch.testing.assert_close(r["grad_logp_only"].double(), ref["grad"][..., lo:hi], atol=1e-5, rtol=0)
