"""PPO's advantages as the loop computes them (objective.compute_advantages): outcome reward on the last token,
KL penalty per token, GAE, whitening, against plain float64 loops written here; and the adaptive KL
controller against Ziegler et al.'s formula."""

from __future__ import annotations

import math

import pytest
import torch

from rlbridge.algo.kl_control import AdaptiveKlController, kl_controller
from rlbridge.algo.objective import compute_advantages, explained_variance
from rlbridge.recipe.schema import GrpoCfg, PpoCfg, RolloutCfg

LENGTHS = [3, 1, 5, 4]
REWARDS = [1.0, 0.0, 0.5, -1.0]


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).to(torch.float64)
    values = torch.randn(4, width, generator=g, dtype=torch.float64)
    logp = -torch.rand(4, width, generator=g, dtype=torch.float64)
    ref = -torch.rand(4, width, generator=g, dtype=torch.float64)
    values[mask == 0] = float("nan")  # padding must not leak
    return mask, values, logp, ref


def reference(gamma: float, lam: float, coef: float) -> tuple[list[list[float]], list[list[float]]]:
    """Plain loops: token rewards (k1 KL penalty, outcome on the last token), GAE, returns; then whitening over
    every valid token with the unbiased variance (eps 1e-8 on the variance)."""
    mask, values, logp, ref = batch()
    advs, rets = [], []
    for i, n in enumerate(LENGTHS):
        r = [-coef * (float(logp[i, t]) - float(ref[i, t])) for t in range(n)]
        r[-1] += REWARDS[i]
        v = [float(values[i, t]) for t in range(n)] + [0.0]
        a, last = [0.0] * n, 0.0
        for t in reversed(range(n)):
            last = r[t] + gamma * v[t + 1] - v[t] + gamma * lam * last
            a[t] = last
        advs.append(a)
        rets.append([a[t] + v[t] for t in range(n)])
    flat = [x for row in advs for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in advs], rets


@pytest.mark.parametrize(("gamma", "lam", "coef"), [(1.0, 0.95, 0.1), (0.9, 0.8, 0.0), (1.0, 1.0, 0.05)])
def test_gae_wiring_matches_a_float64_loop(gamma: float, lam: float, coef: float) -> None:
    mask, values, logp, ref = batch()
    algo = PpoCfg(name="ppo", gamma=gamma, lam=lam, kl={"coef": coef, "where": "reward", "estimator": "k1"})  # type: ignore[arg-type]
    out = compute_advantages(
        algo,
        RolloutCfg(n=1),
        torch.tensor(REWARDS, dtype=torch.float64),
        mask,
        logp_bt=logp,
        ref_logp_bt=ref,
        values_bt=values,
    )
    want_adv, want_ret = reference(gamma, lam, coef)
    assert out.returns_bt is not None and out.old_values_bt is not None
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(
            out.adv_bt[i, :n], torch.tensor(want_adv[i], dtype=torch.float64), rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            out.returns_bt[i, :n], torch.tensor(want_ret[i], dtype=torch.float64), rtol=1e-12, atol=1e-12
        )
        assert (
            (out.adv_bt[i, n:] == 0).all()
            and (out.returns_bt[i, n:] == 0).all()
            and (out.old_values_bt[i, n:] == 0).all()
        )
    assert {"value_ev", "value_mean", "return_mean"} <= set(out.metrics)
    if coef > 0:
        assert out.metrics["kl_coef"] == coef
        seq_kl = sum(float(logp[i, :n].sum() - ref[i, :n].sum()) for i, n in enumerate(LENGTHS)) / len(
            LENGTHS
        )
        assert out.kl_seq_mean == pytest.approx(seq_kl, rel=1e-12)


def test_kl_coef_override_is_what_the_reward_uses() -> None:
    mask, values, logp, ref = batch()
    algo = PpoCfg(name="ppo", kl={"coef": 0.1, "where": "reward", "estimator": "k1"}, adaptive_kl_target=1.0)  # type: ignore[arg-type]
    out = compute_advantages(
        algo,
        RolloutCfg(n=1),
        torch.tensor(REWARDS, dtype=torch.float64),
        mask,
        logp_bt=logp,
        ref_logp_bt=ref,
        values_bt=values,
        kl_coef=0.3,
    )
    assert out.metrics["kl_coef"] == 0.3 and out.returns_bt is not None
    want = reference(1.0, 0.95, 0.3)[1]
    torch.testing.assert_close(
        out.returns_bt[0, :3], torch.tensor(want[0], dtype=torch.float64), rtol=1e-12, atol=1e-12
    )


def test_ppo_without_values_is_an_error() -> None:
    mask, *_ = batch()
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(PpoCfg(name="ppo"), RolloutCfg(n=1), torch.zeros(4), mask)


def test_explained_variance_float64() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    returns = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 5.0]])
    values = torch.tensor([[1.5, 2.0, -7.0], [2.0, 4.0, 6.0]])
    r, v = [1.0, 2.0, 3.0, 4.0, 5.0], [1.5, 2.0, 2.0, 4.0, 6.0]
    d = [a - b for a, b in zip(r, v, strict=True)]

    def var(x: list[float]) -> float:
        m = sum(x) / len(x)
        return sum((y - m) ** 2 for y in x) / (len(x) - 1)

    assert explained_variance(returns, values, mask) == pytest.approx(1 - var(d) / var(r), rel=1e-12)
    assert explained_variance(returns, returns, mask) == 1.0
    assert explained_variance(torch.ones(2, 3), values, mask) == 0.0  # no variance to explain


def test_adaptive_kl_controller_follows_ziegler() -> None:
    ctl = AdaptiveKlController(coef=0.05, target=6.0, horizon=100)
    coef = 0.05
    for kl, n in [(12.0, 16), (6.0, 16), (1.0, 8), (6.6, 32), (5.4, 16), (0.0, 16)]:
        error = min(max(kl / 6.0 - 1.0, -0.2), 0.2)
        coef = coef * (1.0 + error * n / 100)
        assert ctl.update(kl, n) == coef  # the same float64 operations: exact
    assert ctl.coef == pytest.approx(0.05 * 1.032 * 1.0 * 0.984 * 1.032 * 0.984 * 0.968, rel=1e-12)
    fresh = AdaptiveKlController(coef=0.05, target=6.0, horizon=100)
    fresh.load_state(ctl.state())
    assert fresh.coef == ctl.coef and fresh.update(9.0, 16) == ctl.update(9.0, 16)


def test_kl_controller_only_with_a_target() -> None:
    assert kl_controller(GrpoCfg()) is None
    assert kl_controller(PpoCfg(name="ppo")) is None
    ctl = kl_controller(
        PpoCfg(
            name="ppo",
            kl={"coef": 0.2, "where": "reward"},
            adaptive_kl_target=3.0,  # type: ignore[arg-type]
            adaptive_kl_horizon=500,
        )
    )
    assert ctl == AdaptiveKlController(coef=0.2, target=3.0, horizon=500)
