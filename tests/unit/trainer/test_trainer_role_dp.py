"""TrainerRole under data parallelism: each rank's share of a mini-batch, with the mini-batch's loss
normalization, gives DDP-averaged gradients equal to the single-rank update (float64, exact), and the
log-prob shares concatenate to the full batch. A fake engine stands in for megatron (no processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.recipe.schema import Recipe
from rlbridge.trainer.role import TrainerRole

VOCAB = 11


class FakeEngine:
    """A unigram policy (one logit per token id, float64) with the engines' micro-batch contract:
    backpropagates loss_fn(...) / num_micro_batches per tensor_split row group. Records each step's gradient
    instead of stepping, so every update sees the same parameters."""

    LOSS_SCALED_BY_MICRO_BATCHES = True

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.data_parallel = (dp_rank, dp_size)
        self.theta = torch.linspace(-1.0, 1.0, VOCAB, dtype=torch.float64).requires_grad_(True)
        self.grads: list[torch.Tensor] = []

    def _logp(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logp_v = torch.log_softmax(self.theta, dim=0)
        logp = logp_v[batch.response_ids] * batch.response_mask
        entropy = -(logp_v.exp() * logp_v).sum().expand_as(logp) * batch.response_mask
        return logp, entropy

    def logprobs(self, batch: SeqBatch, *, reference: bool = False) -> torch.Tensor:
        with torch.no_grad():
            return self._logp(batch)[0].float()

    def train_step(self, batch: SeqBatch, loss_fn: Any, *, num_micro_batches: int) -> dict[str, float]:
        metrics: list[dict[str, float]] = []
        for rows in torch.arange(batch.size).tensor_split(num_micro_batches):
            logp, ent = self._logp(batch.select(rows))
            loss, m = loss_fn(logp, ent, rows)
            (loss / num_micro_batches).backward()
            metrics.append({**m, "loss": float(loss.detach())})
        assert self.theta.grad is not None
        self.grads.append(self.theta.grad.clone())
        self.theta.grad = None
        return {"loss": sum(m["loss"] for m in metrics) / len(metrics), "grad_norm": 1.0, "skipped": 0.0}


def _recipe(**algorithm: Any) -> Recipe:
    return Recipe.model_validate({
        "name": "dp", "model": {"path": "unused", "dtype": "float32"},
        "trainer": {"micro_batch_size": 1}, "rollout": {"n": 2},
        "algorithm": {"name": "grpo", **algorithm},
        "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4, "mini_batch_size": 2},
        "run": {"health": {"first_step": False}},
    })  # fmt: skip


def _batch() -> tuple[SeqBatch, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    responses = [
        torch.randint(0, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(8)
    ]
    batch = SeqBatch.from_token_lists([[1, 2]] * 8, responses, pad_id=0)
    adv = torch.randn(8, 1, generator=g).expand(8, batch.response_width) * batch.response_mask
    rollout = torch.randn(8, batch.response_width, generator=g) * 0.01 - 2.0
    return batch, adv, rollout * batch.response_mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_dp2_shares_average_to_the_single_rank_update(agg: str) -> None:
    recipe = _recipe(loss_agg=agg)
    batch, adv, rollout = _batch()
    one = TrainerRole(recipe, "unused", engine_factory=lambda: FakeEngine(0, 1))
    two = [TrainerRole(recipe, "unused", engine_factory=lambda r=r: FakeEngine(r, 2)) for r in range(2)]
    m1 = one.update(batch, adv, rollout, None)
    m2 = [role.update(batch, adv, rollout, None) for role in two]
    g1 = one.engine.grads  # type: ignore[attr-defined]
    assert len(g1) == 2  # two mini-batches, off-policy: old log-probs were computed by each rank for its rows
    for step in range(2):
        ddp_average = (two[0].engine.grads[step] + two[1].engine.grads[step]) / 2  # type: ignore[attr-defined]
        assert g1[step].abs().sum() > 0
        torch.testing.assert_close(ddp_average, g1[step], rtol=1e-12, atol=1e-14)
    assert m1["loss"] == pytest.approx(sum(m["loss"] for m in m2) / 2, rel=1e-9)
    mean_diff = sum(m["logprob_diff_mean"] for m in m2) / 2  # what TrainerGroup reports (equal-size shares)
    assert mean_diff == pytest.approx(m1["logprob_diff_mean"], rel=0.2)


def test_logprob_shares_concatenate_to_the_batch() -> None:
    recipe = _recipe()
    batch, _, _ = _batch()
    full = TrainerRole(recipe, "unused", engine_factory=lambda: FakeEngine(0, 1)).logprobs(batch)
    shares = [
        TrainerRole(recipe, "unused", engine_factory=lambda r=r: FakeEngine(r, 3)).logprobs(batch)
        for r in range(3)
    ]
    assert [len(s) for s in shares] == [3, 3, 2]
    torch.testing.assert_close(torch.cat(shares), full)
