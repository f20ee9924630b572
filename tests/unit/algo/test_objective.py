"""The recipe glue: micro-batch loss shares add up exactly to the mini-batch loss; advantages per algorithm."""

from __future__ import annotations

import pytest
import torch

from rlbridge.algo import losses as L
from rlbridge.algo.objective import LossInputs, compute_advantages, make_loss_fn
from rlbridge.recipe.schema import DapoCfg, DrGrpoCfg, GrpoCfg, GspoCfg, ReinforcePPCfg, RlooCfg, RolloutCfg

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def ragged(b: int = 8, t: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64) * mask
    return logp, adv, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_micro", [1, 2, 4, 8])
def test_micro_batch_shares_sum_to_the_full_batch_loss(mode: str, num_micro: int) -> None:
    """float64; exact up to rounding (rel 1e-12): gradient accumulation == one big batch."""
    logp, adv, mask = ragged()
    old = logp - 0.05 * torch.randn_like(logp)  # ratios != 1 so clipping is active somewhere
    algo = GrpoCfg(loss_agg=mode)  # type: ignore[arg-type]
    inputs = LossInputs(adv_bt=adv, mask_bt=mask, old_logp_bt=old, ref_logp_bt=None, rollout_logp_bt=None)
    fn = make_loss_fn(algo, inputs, norm_constant=16.0)
    rows = torch.arange(8).chunk(num_micro)
    total = sum(fn(logp[r], torch.zeros_like(logp[r]), r)[0] for r in rows)
    ref, _ = L.total_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, agg=mode)  # type: ignore[arg-type]
    if mode == "seq-mean-token-sum-norm":
        ref = (
            ref * mask.shape[1] / 16.0
        )  # Dr.GRPO's constant is max_response_tokens (16 here), not the padded width
    assert torch.allclose(total, ref, rtol=1e-12, atol=0), (float(total), float(ref))


def test_micro_scale_undoes_engine_averaging() -> None:
    logp, adv, mask = ragged()
    inputs = LossInputs(adv, mask, None, None, None)
    plain = make_loss_fn(GrpoCfg(), inputs, norm_constant=7.0)
    scaled = make_loss_fn(GrpoCfg(), inputs, norm_constant=7.0, micro_scale=4.0)
    r = torch.arange(2)
    assert torch.allclose(scaled(logp[r], logp[r], r)[0], 4 * plain(logp[r], logp[r], r)[0])


def test_on_policy_ratio_is_one_and_reports_rollout_agreement() -> None:
    logp, adv, mask = ragged()
    rollout = logp + 0.01 * mask
    fn = make_loss_fn(GrpoCfg(), LossInputs(adv, mask, None, None, rollout), norm_constant=7.0)
    r = torch.arange(8)
    _, m = fn(logp, torch.zeros_like(logp), r)
    assert m["ratio_min"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.0)
    assert m["logprob_diff_mean"] == pytest.approx(0.01) and m["logprob_diff_max"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    "algo",
    [
        GrpoCfg(),
        DrGrpoCfg(name="dr_grpo"),
        DapoCfg(name="dapo"),
        GspoCfg(name="gspo"),
        RlooCfg(name="rloo"),
        ReinforcePPCfg(name="reinforce_pp"),
    ],
    ids=lambda a: a.name,
)
def test_advantages_per_algorithm(algo: object) -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    _, _, mask = ragged(8, 5)
    out = compute_advantages(algo, RolloutCfg(n=4), rewards, mask.float())  # type: ignore[arg-type]
    adv = out.adv_bt
    assert adv.shape == mask.shape and bool((adv[mask == 0] == 0).all())
    if algo.name != "reinforce_pp":  # type: ignore[attr-defined]
        assert bool((adv[4:] == 0).all())  # an all-equal group carries no signal
        assert adv[0, 0] > 0 > adv[1, 0]
