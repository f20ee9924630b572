"""rlbridge.algo.advantages against independent float64 references written as plain Python loops.

Inputs are drawn fresh on every run from a seed printed in every assertion message; rerun a failure with
``RLBRIDGE_TEST_SEED=<seed>``.  Unless a test says otherwise, the function runs in float64 and must match
the loop reference to ``rtol=1e-10, atol=1e-12``.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence

import pytest
import torch

from rlbridge.algo.advantages import (
    dynamic_sampling_filter,
    expand_to_tokens,
    gae,
    grpo_advantages,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12
TRIALS = 20
NAN = float("nan")


@pytest.fixture
def seed() -> int:
    env = os.environ.get("RLBRIDGE_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def _msg(seed: int, what: str) -> str:
    return f"{what} [seed={seed}; rerun with RLBRIDGE_TEST_SEED={seed}]"


def _assert_close(
    actual: torch.Tensor | Sequence[float],
    expected: Sequence[float],
    seed: int,
    what: str,
    *,
    rtol: float,
    atol: float,
) -> None:
    got = actual.detach().reshape(-1).tolist() if isinstance(actual, torch.Tensor) else list(actual)
    assert len(got) == len(expected), _msg(seed, f"{what}: {len(got)} values, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert math.isclose(a, e, rel_tol=rtol, abs_tol=atol), _msg(
            seed, f"{what}[{i}]: got {a!r}, want {e!r}"
        )


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


# ---------------------------------------------------------------------------------------------------
# random inputs (plain Python lists; tensors built from them)
# ---------------------------------------------------------------------------------------------------


def _group_rewards(rng: random.Random, num_groups: int, group_size: int) -> list[float]:
    """Per group one of: all identical (incl. 0.1-like values), binary 0/1, continuous."""
    out: list[float] = []
    for _ in range(num_groups):
        kind = rng.choice(["same", "same", "binary", "continuous"])
        if kind == "same":
            v = rng.choice([0.0, 1.0, 0.1, -0.7, rng.gauss(0, 3)])
            out += [v] * group_size
        elif kind == "binary":
            out += [float(rng.random() < 0.5) for _ in range(group_size)]
        else:
            out += [rng.gauss(0, 2) for _ in range(group_size)]
    return out


def _ragged_mask(rng: random.Random, b: int, t: int, *, holes: bool = False) -> list[list[int]]:
    """Right-padded rows of random length (some empty, some full); optional interior holes."""
    rows = []
    for _ in range(b):
        n = rng.choice([0, t, rng.randint(1, t), rng.randint(1, t)])
        row = [1] * n + [0] * (t - n)
        if holes:
            row = [m if rng.random() > 0.25 else 0 for m in row]
        rows.append(row)
    return rows


def _with_nan_padding(values: list[list[float]], mask: list[list[int]]) -> list[list[float]]:
    return [
        [v if m else NAN for v, m in zip(vr, mr, strict=True)] for vr, mr in zip(values, mask, strict=True)
    ]


# ---------------------------------------------------------------------------------------------------
# loop references
# ---------------------------------------------------------------------------------------------------


def ref_grpo(r: list[float], n: int, norm_std: bool, eps: float) -> list[float]:
    out = []
    for g in range(len(r) // n):
        rs = r[g * n : (g + 1) * n]
        mean = sum(rs) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (n - 1))
        for x in rs:
            if max(rs) == min(rs):
                out.append(0.0)  # exact mathematical value
            elif norm_std:
                out.append((x - mean) / (std + eps))
            else:
                out.append(x - mean)
    return out


def ref_rloo(r: list[float], n: int) -> list[float]:
    out = []
    for g in range(len(r) // n):
        rs = r[g * n : (g + 1) * n]
        for i in range(n):
            others = [rs[j] for j in range(n) if j != i]
            out.append(rs[i] - sum(others) / len(others))
    return out


def ref_whiten(x: list[list[float]], mask: list[list[int]], eps: float) -> list[list[float]]:
    vals = [v for xr, mr in zip(x, mask, strict=True) for v, m in zip(xr, mr, strict=True) if m]
    mean = sum(vals) / len(vals) if vals else 0.0
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
    scale = 1.0 / math.sqrt(var + eps)
    return [
        [(v - mean) * scale if m else 0.0 for v, m in zip(xr, mr, strict=True)]
        for xr, mr in zip(x, mask, strict=True)
    ]


def ref_reinforce_pp(
    r: list[float], mask: list[list[int]], group_size: int | None, baseline: bool, eps: float
) -> list[list[float]]:
    scores = list(r)
    if baseline:
        assert group_size is not None
        for g in range(len(r) // group_size):
            idx = range(g * group_size, (g + 1) * group_size)
            mean = sum(r[i] for i in idx) / group_size
            for i in idx:
                scores[i] = r[i] - mean
    # gamma = 1: return at a valid token = sum of rewards from there on = the outcome reward.
    returns = []
    for i, row in enumerate(mask):
        last = max((t for t, m in enumerate(row) if m), default=-1)
        returns.append([scores[i] if (m and t <= last) else 0.0 for t, m in enumerate(row)])
    return ref_whiten(returns, mask, eps)


def ref_gae(
    rewards: list[list[float]], values: list[list[float]], mask: list[list[int]], gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    adv_rows, ret_rows = [], []
    for rr, vr, mr in zip(rewards, values, mask, strict=True):
        valid = [t for t, m in enumerate(mr) if m]
        adv = [0.0] * len(mr)
        ret = [0.0] * len(mr)
        next_adv = 0.0
        for k in reversed(range(len(valid))):
            t = valid[k]
            next_v = vr[valid[k + 1]] if k + 1 < len(valid) else 0.0
            delta = rr[t] + gamma * next_v - vr[t]
            next_adv = delta + gamma * lam * next_adv
            adv[t] = next_adv
            ret[t] = next_adv + vr[t]
        adv_rows.append(adv)
        ret_rows.append(ret)
    return adv_rows, ret_rows


def ref_overlong(length: float, max_len: int, buffer: int, factor: float) -> float:
    if length <= max_len - buffer:
        return 0.0
    if length >= max_len:
        return -factor
    return -factor * (length - (max_len - buffer)) / buffer


# ---------------------------------------------------------------------------------------------------
# GRPO / Dr. GRPO
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_matches_loop_reference_float64(seed: int, norm_std: bool) -> None:
    """float64, rtol 1e-10 / atol 1e-12; groups of identical, binary and continuous rewards."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        n, g = rng.randint(2, 6), rng.randint(1, 5)
        r = _group_rewards(rng, g, n)
        got = grpo_advantages(torch.tensor(r, dtype=F64), n, norm_std=norm_std, eps=1e-6)
        assert got.dtype == F64 and got.shape == (g * n,)
        _assert_close(got, ref_grpo(r, n, norm_std, 1e-6), seed, f"trial {trial} grpo", rtol=RTOL, atol=ATOL)


def test_grpo_float32_matches_float64_reference(seed: int) -> None:
    """float32 computation vs the float64 loop on the same (float32-rounded) rewards: rtol 1e-5, atol 1e-5."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        n, g = rng.randint(2, 8), rng.randint(1, 5)
        r32 = torch.tensor(_group_rewards(rng, g, n), dtype=torch.float32)
        got = grpo_advantages(r32, n)
        assert got.dtype == torch.float32
        want = ref_grpo(r32.double().tolist(), n, True, 1e-6)
        _assert_close(got, want, seed, f"trial {trial} grpo f32", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_groups_sum_to_zero(seed: int, norm_std: bool) -> None:
    """Each group's advantages sum to 0 (float64, atol 1e-10 relative to the reward scale)."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        n, g = rng.randint(2, 8), rng.randint(1, 6)
        adv = grpo_advantages(torch.tensor(_group_rewards(rng, g, n), dtype=F64), n, norm_std=norm_std)
        sums = adv.view(g, n).sum(dim=1).tolist()
        _assert_close(sums, [0.0] * g, seed, f"trial {trial} group sums", rtol=0.0, atol=1e-10)


def test_grpo_identical_groups_are_exactly_zero() -> None:
    r = torch.tensor([0.1] * 5 + [1.0, 0.0, 1.0, 1.0, 0.0] + [-3.3] * 5, dtype=torch.float32)
    for norm_std in (True, False):
        adv = grpo_advantages(r, 5, norm_std=norm_std).view(3, 5)
        assert torch.equal(adv[0], torch.zeros(5)) and torch.equal(adv[2], torch.zeros(5))
        assert bool((adv[1] != 0).all())


def test_grpo_hand_values() -> None:
    # group [1, 0]: mean 0.5, unbiased std = sqrt(0.5); dr_grpo: +-0.5
    adv = grpo_advantages(torch.tensor([1.0, 0.0], dtype=F64), 2, eps=0.0)
    assert adv.tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], rel=1e-12)
    assert grpo_advantages(torch.tensor([1.0, 0.0]), 2, norm_std=False).tolist() == [0.5, -0.5]


@pytest.mark.parametrize("bad", [dict(group_size=1), dict(group_size=3)])
def test_group_layout_errors(bad: dict[str, int]) -> None:
    r = torch.zeros(4)
    for fn in (grpo_advantages, rloo_advantages, dynamic_sampling_filter):
        with pytest.raises(ValueError):
            fn(r, bad["group_size"])


# ---------------------------------------------------------------------------------------------------
# RLOO
# ---------------------------------------------------------------------------------------------------


def test_rloo_matches_loop_reference(seed: int) -> None:
    """float64, rtol 1e-10 / atol 1e-12."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        n, g = rng.randint(2, 6), rng.randint(1, 5)
        r = _group_rewards(rng, g, n)
        got = rloo_advantages(torch.tensor(r, dtype=F64), n)
        _assert_close(got, ref_rloo(r, n), seed, f"trial {trial} rloo", rtol=RTOL, atol=ATOL)
        # identity: RLOO = n / (n - 1) * (r - group mean), hence also sums to 0 per group
        dr = grpo_advantages(torch.tensor(r, dtype=F64), n, norm_std=False)
        _assert_close(
            got,
            (dr * n / (n - 1)).tolist(),
            seed,
            f"trial {trial} rloo=n/(n-1)*drgrpo",
            rtol=1e-9,
            atol=1e-12,
        )


def test_rloo_needs_two_samples() -> None:
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(torch.ones(3), 1)


# ---------------------------------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_loop_reference(seed: int, baseline: bool) -> None:
    """float64, rtol 1e-10 / atol 1e-12; ragged mask with empty rows; zeros on padding."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        n, g, t = rng.randint(2, 4), rng.randint(1, 4), rng.randint(1, 7)
        r = _group_rewards(rng, g, n)
        mask = _ragged_mask(rng, g * n, t)
        got = reinforce_pp_advantages(
            torch.tensor(r, dtype=F64), torch.tensor(mask), group_size=n, baseline=baseline, eps=1e-8
        )
        assert got.shape == (g * n, t)
        want = ref_reinforce_pp(r, mask, n, baseline, 1e-8)
        _assert_close(got, _flat(want), seed, f"trial {trial} reinforce++", rtol=1e-9, atol=1e-10)
        assert bool((got[~torch.tensor(mask, dtype=torch.bool)] == 0).all()), _msg(seed, "padding must be 0")


def test_reinforce_pp_baseline_needs_group_size() -> None:
    with pytest.raises(ValueError, match="group_size"):
        reinforce_pp_advantages(torch.ones(2), torch.ones(2, 3), baseline=True)


# ---------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_loop_reference(seed: int, holes: bool) -> None:
    """float64, rtol 1e-10 / atol 1e-12; NaN in padded rewards/values must not leak; holes are skipped."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        b, t = rng.randint(1, 5), rng.randint(1, 8)
        gamma, lam = rng.choice([1.0, 0.99, rng.random()]), rng.choice([1.0, 0.95, 0.0, rng.random()])
        mask = _ragged_mask(rng, b, t, holes=holes)
        rewards = [[rng.gauss(0, 1) for _ in range(t)] for _ in range(b)]
        values = [[rng.gauss(0, 1) for _ in range(t)] for _ in range(b)]
        adv, ret = gae(
            torch.tensor(_with_nan_padding(rewards, mask), dtype=F64),
            torch.tensor(_with_nan_padding(values, mask), dtype=F64),
            torch.tensor(mask),
            gamma=gamma,
            lam=lam,
        )
        want_adv, want_ret = ref_gae(rewards, values, mask, gamma, lam)
        what = f"trial {trial} gae gamma={gamma} lam={lam}"
        _assert_close(adv, _flat(want_adv), seed, what + " adv", rtol=RTOL, atol=ATOL)
        _assert_close(ret, _flat(want_ret), seed, what + " returns", rtol=RTOL, atol=ATOL)


def test_gae_lambda1_gamma1_returns_are_reward_to_go(seed: int) -> None:
    """lam = gamma = 1: returns_t = sum of the rewards from t to the end (values cancel), float64."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        b, t = rng.randint(1, 4), rng.randint(1, 8)
        mask = _ragged_mask(rng, b, t)
        rewards = [[rng.gauss(0, 1) for _ in range(t)] for _ in range(b)]
        values = [[rng.gauss(0, 5) for _ in range(t)] for _ in range(b)]
        _, ret = gae(
            torch.tensor(rewards, dtype=F64),
            torch.tensor(values, dtype=F64),
            torch.tensor(mask),
            gamma=1.0,
            lam=1.0,
        )
        want = [
            [sum(rr[s] for s in range(j, t) if mr[s]) if mr[j] else 0.0 for j in range(t)]
            for rr, mr in zip(rewards, mask, strict=True)
        ]
        _assert_close(ret, _flat(want), seed, f"trial {trial} reward-to-go", rtol=1e-9, atol=1e-9)


def test_gae_lambda0_is_one_step_td(seed: int) -> None:
    """lam = 0: A_t = r_t + gamma * V_{t+1} - V_t (V = 0 after the last valid token), float64."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        b, t, gamma = rng.randint(1, 4), rng.randint(1, 8), rng.random()
        mask = _ragged_mask(rng, b, t)
        rewards = [[rng.gauss(0, 1) for _ in range(t)] for _ in range(b)]
        values = [[rng.gauss(0, 1) for _ in range(t)] for _ in range(b)]
        adv, _ = gae(
            torch.tensor(rewards, dtype=F64),
            torch.tensor(values, dtype=F64),
            torch.tensor(mask),
            gamma=gamma,
            lam=0.0,
        )
        want = []
        for rr, vr, mr in zip(rewards, values, mask, strict=True):
            for j in range(t):
                nxt = vr[j + 1] if j + 1 < t and mr[j + 1] else 0.0
                want.append(rr[j] + gamma * nxt - vr[j] if mr[j] else 0.0)
        _assert_close(adv, want, seed, f"trial {trial} one-step TD", rtol=RTOL, atol=ATOL)


def test_gae_rejects_bad_params() -> None:
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        gae(z, z, z, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError):
        gae(z, torch.zeros(1, 3), z, gamma=1.0, lam=1.0)


# ---------------------------------------------------------------------------------------------------
# masked helpers
# ---------------------------------------------------------------------------------------------------


def test_masked_stats_match_loops(seed: int) -> None:
    """masked_sum / mean / var (both biases) / whiten vs loops, float64 rtol 1e-10; NaN padding ignored."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        b, t = rng.randint(1, 5), rng.randint(1, 7)
        mask = _ragged_mask(rng, b, t, holes=True)
        x = [[rng.gauss(1, 3) for _ in range(t)] for _ in range(b)]
        xt, mt = torch.tensor(_with_nan_padding(x, mask), dtype=F64), torch.tensor(mask)
        vals = [v for xr, mr in zip(x, mask, strict=True) for v, m in zip(xr, mr, strict=True) if m]
        mean = sum(vals) / len(vals) if vals else 0.0
        sq = sum((v - mean) ** 2 for v in vals)
        what = f"trial {trial}"
        _assert_close([masked_sum(xt, mt).item()], [sum(vals)], seed, what + " sum", rtol=RTOL, atol=ATOL)
        _assert_close([masked_mean(xt, mt).item()], [mean], seed, what + " mean", rtol=RTOL, atol=ATOL)
        want_var = sq / (len(vals) - 1) if len(vals) > 1 else 0.0
        _assert_close([masked_var(xt, mt).item()], [want_var], seed, what + " var", rtol=RTOL, atol=ATOL)
        want_pvar = sq / len(vals) if vals else 0.0
        _assert_close(
            [masked_var(xt, mt, unbiased=False).item()],
            [want_pvar],
            seed,
            what + " pvar",
            rtol=RTOL,
            atol=ATOL,
        )
        row_means = [
            sum(v for v, m in zip(xr, mr, strict=True) if m) / max(sum(mr), 1)
            for xr, mr in zip(x, mask, strict=True)
        ]
        _assert_close(masked_mean(xt, mt, dim=1), row_means, seed, what + " row means", rtol=RTOL, atol=ATOL)
        _assert_close(
            masked_whiten(xt, mt),
            _flat(ref_whiten(x, mask, 1e-8)),
            seed,
            what + " whiten",
            rtol=1e-9,
            atol=1e-10,
        )


def test_masked_helpers_on_empty_mask_give_zero_not_nan() -> None:
    x, m = torch.full((2, 3), float("nan")), torch.zeros(2, 3)
    assert (
        masked_mean(x, m).item() == 0.0 and masked_var(x, m).item() == 0.0 and masked_sum(x, m).item() == 0.0
    )
    assert masked_mean(x, m, dim=1).tolist() == [0.0, 0.0]
    assert torch.equal(masked_whiten(x, m), torch.zeros(2, 3))


def test_expand_and_outcome_placement() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    r = torch.tensor([2.0, 3.0, 5.0])
    assert expand_to_tokens(r, mask).tolist() == [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [5.0, 0.0, 5.0]]
    assert outcome_to_token_rewards(r, mask).tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 5.0]]
    with pytest.raises(ValueError):
        expand_to_tokens(r[:2], mask)


# ---------------------------------------------------------------------------------------------------
# DAPO: dynamic sampling, overlong penalty
# ---------------------------------------------------------------------------------------------------


def test_dynamic_sampling_drops_exactly_all_equal_groups(seed: int) -> None:
    rng = random.Random(seed)
    for trial in range(TRIALS):
        n, g = rng.randint(2, 6), rng.randint(1, 8)
        r = _group_rewards(rng, g, n)
        keep, dropped = dynamic_sampling_filter(torch.tensor(r, dtype=torch.float32), n)
        want = [len(set(r[i * n : (i + 1) * n])) > 1 for i in range(g)]
        assert keep.dtype == torch.bool and keep.tolist() == want, _msg(seed, f"trial {trial} keep mask")
        assert dropped == want.count(False), _msg(seed, f"trial {trial} num_dropped")


def test_dynamic_sampling_hand_example() -> None:
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.1, 0.1, 0.1, 0.0, 0.0, 0.0])
    keep, dropped = dynamic_sampling_filter(r, 3)
    # groups: [1,1,1] drop, [0,1,0] keep, [0.1,0.1,0.1] drop, [0,0,0] drop
    assert keep.tolist() == [False, True, False, False] and dropped == 3


def test_overlong_penalty_piecewise_hand_values() -> None:
    lengths = torch.tensor([0, 50, 80, 81, 90, 95, 99, 100, 101, 500])
    got = overlong_penalty(lengths, max_len=100, buffer=20, penalty_factor=2.0)
    want = [0.0, 0.0, 0.0, -0.1, -1.0, -1.5, -1.9, -2.0, -2.0, -2.0]
    assert got.dtype == torch.get_default_dtype()
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_overlong_penalty_matches_loop_reference(seed: int) -> None:
    """float64 lengths, rtol 1e-10 / atol 1e-12."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        max_len = rng.randint(1, 64)
        buffer, factor = rng.randint(1, max_len), rng.uniform(0.1, 3)
        lengths = [float(rng.randint(0, max_len + 5)) for _ in range(10)]
        got = overlong_penalty(
            torch.tensor(lengths, dtype=F64), max_len=max_len, buffer=buffer, penalty_factor=factor
        )
        want = [ref_overlong(x, max_len, buffer, factor) for x in lengths]
        _assert_close(got, want, seed, f"trial {trial} overlong", rtol=RTOL, atol=ATOL)


def test_overlong_penalty_rejects_bad_buffer() -> None:
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=0)
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=11)
