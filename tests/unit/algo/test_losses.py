"""rlbridge.algo.losses against independent float64 references written as plain Python loops.

Inputs are drawn fresh on every run from a seed printed in every assertion message; rerun a failure with
``RLBRIDGE_TEST_SEED=<seed>``.  Unless a test says otherwise, the function runs in float64 and must match
the loop reference (values *and* autograd gradients) to ``rtol=1e-10, atol=1e-12``.  Padded positions hold
NaN in every input, so any leak of padding into a value or a gradient fails the comparison.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from rlbridge.algo.losses import (
    AggMode,
    KLKind,
    RatioLevel,
    aggregate,
    entropy_bonus,
    entropy_from_logits,
    kl_estimate,
    kl_in_reward,
    policy_loss,
    total_loss,
    value_loss,
)

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12
TRIALS = 25
NAN = float("nan")
AGG_MODES: list[AggMode] = [
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
Grid = list[list[float]]
Mask = list[list[int]]


@pytest.fixture
def seed() -> int:
    env = os.environ.get("RLBRIDGE_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def _msg(seed: int, what: str) -> str:
    return f"{what} [seed={seed}; rerun with RLBRIDGE_TEST_SEED={seed}]"


def _assert_close(
    actual: torch.Tensor | Sequence[float] | float,
    expected: Sequence[float] | float,
    seed: int,
    what: str,
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> None:
    if isinstance(actual, torch.Tensor):
        got = actual.detach().reshape(-1).tolist()
    else:
        got = [actual] if isinstance(actual, float) else list(actual)
    want = [expected] if isinstance(expected, float) else list(expected)
    assert len(got) == len(want), _msg(seed, f"{what}: {len(got)} values, expected {len(want)}")
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(a, e, rel_tol=rtol, abs_tol=atol), _msg(
            seed, f"{what}[{i}]: got {a!r}, want {e!r}"
        )


def _flat(rows: Grid) -> list[float]:
    return [x for row in rows for x in row]


def _ragged_mask(rng: random.Random, b: int, t: int) -> Mask:
    """Right-padded rows of random length; some empty, some full; sometimes an interior hole."""
    rows = []
    for _ in range(b):
        n = rng.choice([0, t, rng.randint(1, t), rng.randint(1, t)])
        row = [1] * n + [0] * (t - n)
        if n > 2 and rng.random() < 0.2:
            row[rng.randrange(1, n - 1)] = 0
        rows.append(row)
    return rows


def _tensor(values: Grid, mask: Mask, *, pad: float = NAN, grad: bool = False) -> torch.Tensor:
    data = [
        [v if m else pad for v, m in zip(vr, mr, strict=True)] for vr, mr in zip(values, mask, strict=True)
    ]
    return torch.tensor(data, dtype=F64, requires_grad=grad)


def _log_ratio(rng: random.Random) -> float:
    """Mostly moderate, sometimes exactly 0, sometimes extreme (up to +-30)."""
    kind = rng.random()
    if kind < 0.15:
        return 0.0
    if kind < 0.6:
        return rng.gauss(0, 0.15)
    if kind < 0.85:
        return rng.gauss(0, 1.0)
    return rng.uniform(-30, 30)


@dataclass
class PolicyCase:
    old: Grid
    logp: Grid
    adv: Grid
    mask: Mask
    clip_low: float
    clip_high: float
    dual_clip: float | None
    extra: dict[str, float] = field(default_factory=dict)


def _policy_case(rng: random.Random) -> PolicyCase:
    b, t = rng.randint(1, 5), rng.randint(1, 6)
    old = [[rng.uniform(-8, 0) for _ in range(t)] for _ in range(b)]
    logp = [[o + _log_ratio(rng) for o in row] for row in old]
    adv = []
    for _ in range(b):
        a = rng.choice([0.0, rng.gauss(0, 1), rng.gauss(0, 1)])
        adv.append([a if rng.random() < 0.7 else rng.gauss(0, 1) for _ in range(t)])
    return PolicyCase(
        old,
        logp,
        adv,
        _ragged_mask(rng, b, t),
        clip_low=rng.choice([0.2, 0.1, rng.uniform(0, 1)]),
        clip_high=rng.choice([0.28, 0.2, rng.uniform(0, 2)]),
        dual_clip=rng.choice([None, 3.0, rng.uniform(1.01, 10)]),
    )


# ---------------------------------------------------------------------------------------------------
# loop references
# ---------------------------------------------------------------------------------------------------


def ref_weights(mask: Mask, mode: str, norm_constant: float | None = None) -> Grid:
    """d(aggregate)/d(loss_bt) for each aggregation mode, i.e. the weight of every token."""
    n_tok = sum(sum(r) for r in mask)
    n_seq = sum(1 for r in mask if sum(r) > 0)
    t = len(mask[0])
    out = []
    for row in mask:
        length = sum(row)
        if mode == "token-mean":
            w = 1.0 / n_tok if n_tok else 0.0
        elif mode == "seq-mean-token-sum":
            w = 1.0 / n_seq if n_seq else 0.0
        elif mode == "seq-mean-token-mean":
            w = 1.0 / (n_seq * length) if length else 0.0
        else:
            norm = t if norm_constant is None else norm_constant
            w = 1.0 / (n_seq * norm) if n_seq else 0.0
        out.append([w if m else 0.0 for m in row])
    return out


def ref_aggregate(loss: Grid, mask: Mask, mode: str, norm_constant: float | None = None) -> float:
    """Literal definitions, computed as sums of sums (not via the weights)."""
    seqs = [[v for v, m in zip(lr, mr, strict=True) if m] for lr, mr in zip(loss, mask, strict=True)]
    seqs = [s for s in seqs if s]
    if not seqs:
        return 0.0
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    norm = len(mask[0]) if norm_constant is None else norm_constant
    return sum(sum(s) / norm for s in seqs) / len(seqs)


def ref_policy(case: PolicyCase, agg: str, level: str) -> tuple[float, Grid, dict[str, float]]:
    """Loss, d loss / d logp and metrics of the clipped surrogate, token by token."""
    lo, hi = 1.0 - case.clip_low, 1.0 + case.clip_high
    weights = ref_weights(case.mask, agg)
    losses: Grid = []
    grads: Grid = []
    n_clip = n_dual = n_tok = 0
    kl_sum = ratio_sum = 0.0
    ratios: list[float] = []
    for i, row in enumerate(case.mask):
        lrs = [case.logp[i][j] - case.old[i][j] for j in range(len(row))]
        valid = [lrs[j] for j in range(len(row)) if row[j]]
        seq_lr = min(max(sum(valid) / len(valid), -20.0), 20.0) if valid else 0.0
        loss_row, grad_row = [], []
        for j, m in enumerate(row):
            if not m:
                loss_row.append(0.0)
                grad_row.append(0.0)
                continue
            a = case.adv[i][j]
            if level == "token":
                ratio = math.exp(min(max(lrs[j], -20.0), 20.0))
                dratio = ratio if -20.0 < lrs[j] < 20.0 else 0.0  # the clamp cuts the gradient
            else:
                ratio = dratio = math.exp(seq_lr)  # straight-through: d ratio_t / d logp_t = s_i
            unclipped, clipped = -a * ratio, -a * min(max(ratio, lo), hi)
            loss, grad = (clipped, 0.0) if clipped > unclipped else (unclipped, -a * dratio)
            n_clip += clipped > unclipped
            if case.dual_clip is not None and a < 0 and loss > -a * case.dual_clip:
                loss, grad = -a * case.dual_clip, 0.0
                n_dual += 1
            loss_row.append(loss)
            grad_row.append(grad * weights[i][j])
            n_tok += 1
            kl_sum += 0.5 * lrs[j] ** 2
            ratio_sum += ratio
            ratios.append(ratio)
        losses.append(loss_row)
        grads.append(grad_row)
    metrics = {
        "clip_frac": n_clip / n_tok if n_tok else 0.0,
        "dual_clip_frac": n_dual / n_tok if n_tok else 0.0,
        "approx_kl": kl_sum / n_tok if n_tok else 0.0,
        "ratio_min": min(ratios, default=0.0),
        "ratio_max": max(ratios, default=0.0),
        "ratio_mean": ratio_sum / n_tok if n_tok else 0.0,
    }
    return ref_aggregate(losses, case.mask, agg), grads, metrics


def ref_kl(logp: float, ref: float, kind: str) -> float:
    d = logp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    x = min(max(ref - logp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def ref_entropy(logits: list[float]) -> float:
    top = max(logits)
    z = sum(math.exp(v - top) for v in logits if v != -math.inf)
    h = 0.0
    for v in logits:
        if v == -math.inf:
            continue
        lp = v - top - math.log(z)
        h -= math.exp(lp) * lp
    return h


def _masked_var_loop(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


# ---------------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_loop_reference(seed: int, kind: KLKind) -> None:
    """float64, rtol 1e-10 / atol 1e-12, log-ratios up to +-30 (k3: both clamps exercised)."""
    rng = random.Random(seed)
    ref = [rng.uniform(-10, 0) for _ in range(200)]
    logp = [r + _log_ratio(rng) for r in ref]
    got = kl_estimate(torch.tensor(logp, dtype=F64), torch.tensor(ref, dtype=F64), kind)
    want = [ref_kl(a, b, kind) for a, b in zip(logp, ref, strict=True)]
    _assert_close(got, want, seed, f"kl {kind}")


def test_k3_is_nonnegative_everywhere(seed: int) -> None:
    """k3 >= 0 in float32 and float64: tiny log-ratios (where exp(x) - x - 1 cancels), extremes, random."""
    rng = random.Random(seed)
    tiny = torch.cat(
        [torch.linspace(-1e-3, 1e-3, 20001), torch.logspace(-12, 0, 500), -torch.logspace(-12, 0, 500)]
    )
    extreme = torch.tensor([-30.0, -25.0, -20.0, -5.0, 5.0, 20.0, 25.0, 30.0])
    rand = torch.tensor(
        [rng.uniform(-30, 30) for _ in range(1000)] + [rng.gauss(0, 1e-4) for _ in range(1000)]
    )
    for dtype in (torch.float32, F64, torch.bfloat16):
        d = torch.cat([tiny, extreme, rand]).to(dtype)
        ref = torch.tensor([rng.uniform(-10, 0) for _ in range(d.numel())]).to(dtype)
        for kind in ("k3", "low_var_kl"):
            kl = kl_estimate(ref + d, ref, kind)
            assert bool((kl >= 0).all()) and bool(torch.isfinite(kl).all()), _msg(
                seed, f"{kind} {dtype}: min {kl.min()}"
            )
            kl0 = kl_estimate(ref, ref, kind)
            assert bool((kl0 == 0).all()), _msg(seed, f"{kind} {dtype}: KL(p, p) must be 0")
            assert kl.max().item() <= 10.0


def test_kl_unknown_kind_raises() -> None:
    with pytest.raises(ValueError, match="unknown KL"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------------


def test_aggregate_hand_values_2x3() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # valid tokens: row 0 = 1, 2, 3 (sum 6, mean 2); row 1 = 4 (sum 4, mean 4)
    assert aggregate(loss, mask, "token-mean").item() == 10 / 4
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == (6 + 4) / 2
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == (2 + 4) / 2
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(
        (6 + 4) / (2 * 3), rel=1e-15
    )
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_constant=5).item() == (6 + 4) / (2 * 5)
    # an extra fully padded row (garbage values) changes nothing in any mode
    loss3 = torch.cat([loss, torch.full((1, 3), NAN, dtype=F64)])
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    for mode in AGG_MODES:
        assert aggregate(loss3, mask3, mode).item() == aggregate(loss, mask, mode).item(), mode


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_loop_reference(seed: int, mode: AggMode) -> None:
    """Values and gradients (= per-token weights) on ragged batches with empty rows; float64 rtol 1e-10."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        b, t = rng.randint(1, 5), rng.randint(1, 6)
        mask = _ragged_mask(rng, b, t)
        loss = [[rng.gauss(0, 3) for _ in range(t)] for _ in range(b)]
        norm = rng.choice([None, float(rng.randint(1, 10))]) if mode == "seq-mean-token-sum-norm" else None
        x = _tensor(loss, mask, grad=True)
        got = aggregate(x, torch.tensor(mask), mode, norm_constant=norm)
        got.backward()
        assert x.grad is not None
        what = f"trial {trial} {mode}"
        _assert_close(got, ref_aggregate(loss, mask, mode, norm), seed, what)
        _assert_close(x.grad, _flat(ref_weights(mask, mode, norm)), seed, what + " grad")


def test_aggregate_empty_batch_is_zero_not_nan() -> None:
    x = torch.full((3, 4), NAN, requires_grad=True)
    for mode in AGG_MODES:
        out = aggregate(x, torch.zeros(3, 4, dtype=torch.bool), mode)
        out.backward()
        assert out.item() == 0.0 and x.grad is not None and bool((x.grad == 0).all()), mode
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(x, torch.ones(3, 4), "token-mean", norm_constant=3)


# ---------------------------------------------------------------------------------------------------
# policy loss
# ---------------------------------------------------------------------------------------------------


def _run_policy(
    case: PolicyCase, agg: AggMode, level: RatioLevel
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    logp = _tensor(case.logp, case.mask, grad=True)
    loss, metrics = policy_loss(
        logp,
        _tensor(case.old, case.mask),
        _tensor(case.adv, case.mask),
        torch.tensor(case.mask),
        clip_low=case.clip_low,
        clip_high=case.clip_high,
        dual_clip=case.dual_clip,
        agg=agg,
        level=level,
    )
    loss.backward()
    assert logp.grad is not None
    return loss, logp.grad, metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_matches_loop_reference(seed: int, agg: AggMode, level: RatioLevel) -> None:
    """Loss, gradient and every metric vs the loop reference, float64, rtol 1e-10 / atol 1e-12.

    Covers asymmetric and dual clip, log-ratios up to +-30 (beyond the +-20 clamp), zero advantages,
    empty rows and NaN padding.
    """
    rng = random.Random(seed)
    for trial in range(TRIALS):
        case = _policy_case(rng)
        loss, grad, metrics = _run_policy(case, agg, level)
        want_loss, want_grad, want_metrics = ref_policy(case, agg, level)
        what = f"trial {trial} {level} {agg} clip=({case.clip_low:.3g}, {case.clip_high:.3g}) dual={case.dual_clip}"
        _assert_close(loss, want_loss, seed, what + " loss")
        _assert_close(grad, _flat(want_grad), seed, what + " grad")
        assert set(metrics) == set(want_metrics), _msg(seed, what)
        for key, value in want_metrics.items():
            _assert_close(metrics[key], value, seed, f"{what} {key}")


def test_policy_loss_float32_matches_float64_reference(seed: int) -> None:
    """float32 computation vs the float64 loop on the same float32-rounded inputs: rtol 1e-5, atol 1e-6.

    Log-ratios kept within +-3 here (float32 rounding of a log-prob ~ -8 is ~5e-7 absolute).
    """
    rng = random.Random(seed)
    for trial in range(TRIALS):
        case = _policy_case(rng)
        case.logp = [
            [o + max(min(lp - o, 3.0), -3.0) for lp, o in zip(lr, orow, strict=True)]
            for lr, orow in zip(case.logp, case.old, strict=True)
        ]
        rounded = {k: torch.tensor(getattr(case, k), dtype=torch.float32) for k in ("logp", "old", "adv")}
        for k, v in rounded.items():
            setattr(case, k, v.double().tolist())
        loss32, _ = policy_loss(
            rounded["logp"], rounded["old"], rounded["adv"], torch.tensor(case.mask),
            clip_low=case.clip_low, clip_high=case.clip_high, dual_clip=case.dual_clip,
        )  # fmt: skip
        assert loss32.dtype == torch.float32
        _assert_close(
            loss32,
            ref_policy(case, "token-mean", "token")[0],
            seed,
            f"trial {trial} f32",
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ratio_one_gradient_is_vanilla_policy_gradient(seed: int, level: RatioLevel) -> None:
    """logp == old_logp (ratio 1, no clip active): d loss / d logp = -adv * mask / num_tokens (token-mean)."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        case = _policy_case(rng)
        case.logp = [list(row) for row in case.old]
        loss, grad, metrics = _run_policy(case, "token-mean", level)
        n_tok = sum(map(sum, case.mask))
        want = [
            -a / n_tok if m else 0.0
            for ar, mr in zip(case.adv, case.mask, strict=True)
            for a, m in zip(ar, mr, strict=True)
        ]
        _assert_close(grad, want, seed, f"trial {trial} {level} vanilla PG", rtol=1e-12, atol=1e-15)
        _assert_close(loss, sum(want), seed, f"trial {trial} loss = -mean(adv)", rtol=1e-10, atol=1e-12)
        assert (
            metrics["clip_frac"] == 0.0 and metrics["dual_clip_frac"] == 0.0 and metrics["approx_kl"] == 0.0
        )
        if n_tok:
            assert metrics["ratio_min"] == metrics["ratio_max"] == metrics["ratio_mean"] == 1.0


def test_dual_clip_caps_the_loss_of_negative_advantages() -> None:
    old = torch.zeros(1, 4, dtype=F64)
    logp = torch.tensor(
        [[3.0, 3.0, 25.0, -3.0]], dtype=F64, requires_grad=True
    )  # ratios e^3, e^3, e^20, e^-3
    adv = torch.tensor([[-2.0, 2.0, -0.5, -1.0]], dtype=F64)
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss.backward()
    # token 0: A<0, unclipped 2*e^3 > cap 3*2 -> 6; token 1: A>0, clipped -2*1.28; token 2: cap 1.5;
    # token 3: A<0, ratio e^-3 < 0.8 -> clipped term -A*0.8 = 0.8 (below the cap, unchanged)
    per_token = [6.0, -2.56, 1.5, 0.8]
    assert loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-12)
    assert logp.grad is not None and logp.grad.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert m["dual_clip_frac"] == 0.5 and m["clip_frac"] == 0.5
    loss_nodual, _ = policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    assert loss_nodual.item() > loss.item() + 1e7  # e^20 / 2 uncapped
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip"):
            policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28, dual_clip=bad)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gspo_with_equal_token_log_ratios_equals_token_level(seed: int, agg: AggMode) -> None:
    """All valid tokens of a sequence share one log-ratio: GSPO loss and gradient = token-level PPO.

    float64, rtol 1e-9 (logp - old_logp recovers the shared value only to rounding).
    """
    rng = random.Random(seed)
    for trial in range(TRIALS):
        case = _policy_case(rng)
        shared = [rng.choice([0.0, rng.gauss(0, 0.2), rng.uniform(-3, 3)]) for _ in case.mask]
        case.logp = [[o + c for o in row] for row, c in zip(case.old, shared, strict=True)]
        tok = _run_policy(case, agg, "token")
        seq = _run_policy(case, agg, "sequence")
        what = f"trial {trial} {agg}"
        _assert_close(seq[0], tok[0].item(), seed, what + " loss", rtol=1e-9, atol=1e-12)
        _assert_close(seq[1], tok[1].reshape(-1).tolist(), seed, what + " grad", rtol=1e-9, atol=1e-12)


def test_extreme_ratios_stay_finite() -> None:
    lr = torch.tensor(
        [[30.0, -30.0, 19.0, -19.0, 0.0], [30.0, 30.0, 30.0, -30.0, -30.0]], dtype=torch.float32
    )
    old = torch.full((2, 5), -5.0)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 0.5], [-2.0, -2.0, 3.0, 3.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    levels: list[RatioLevel] = ["token", "sequence"]
    for level in levels:
        for agg in AGG_MODES:
            logp = (old + lr).masked_fill(mask == 0, -math.inf).requires_grad_(True)
            loss, metrics = policy_loss(
                logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg=agg, level=level
            )
            loss.backward()
            assert logp.grad is not None
            assert math.isfinite(loss.item()) and bool(torch.isfinite(logp.grad).all()), (level, agg)
            assert logp.grad[0, 4].item() == 0.0 and all(math.isfinite(v) for v in metrics.values())


def test_policy_loss_rejects_bad_args() -> None:
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        policy_loss(z, z, z, z, clip_low=-0.1, clip_high=0.2)
    with pytest.raises(ValueError):
        policy_loss(z, z, z, torch.ones(1, 2), clip_low=0.2, clip_high=0.2, level="chunk")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# entropy
# ---------------------------------------------------------------------------------------------------


def test_entropy_from_logits_matches_loop_reference(seed: int) -> None:
    """float64 rtol 1e-10 / atol 1e-12, with -inf logits and one-hot rows; chunked == unchunked; finite grads."""
    rng = random.Random(seed)
    b, t, v = 3, 4, 7
    logits = [
        [[rng.gauss(0, rng.choice([0.1, 3.0, 20.0])) for _ in range(v)] for _ in range(t)] for _ in range(b)
    ]
    for row in logits[0]:
        row[rng.randrange(v)] = -math.inf
    logits[1][2] = [-math.inf] * v
    logits[1][2][3] = 1.5  # one-hot: entropy 0
    x = torch.tensor(logits, dtype=F64, requires_grad=True)
    want = [ref_entropy(tok) for seq in logits for tok in seq]
    for chunk in (None, 1, 5, 100):
        got = entropy_from_logits(x, chunk_size=chunk)
        assert got.shape == (b, t)
        _assert_close(got, want, seed, f"entropy chunk={chunk}")
    entropy_from_logits(x, chunk_size=5).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    uniform = entropy_from_logits(torch.zeros(2, 10))
    assert uniform.tolist() == pytest.approx([math.log(10)] * 2, rel=1e-6)


def test_entropy_bonus_is_negative_coef_times_aggregate() -> None:
    ent = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert entropy_bonus(ent, mask, 0.01, "token-mean").item() == pytest.approx(-0.01 * 2.0, rel=1e-12)
    assert entropy_bonus(ent, mask, 0.01, "seq-mean-token-sum").item() == pytest.approx(
        -0.01 * 3.0, rel=1e-12
    )


def test_a_zero_entropy_coefficient_reports_the_entropy_without_a_gradient_path() -> None:
    """entropy_coef 0: the entropy is a metric (its value reported), the loss is the policy loss, and the backward
    does not reach the entropy (engines skip its vocabulary-wide product's backward)."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=F64, requires_grad=True)
    entropy = torch.tensor([[2.0, 1.0], [4.0, 3.0]], dtype=F64, requires_grad=True)
    mask, adv = torch.ones(2, 2), torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    kw = {"clip_low": 0.2, "clip_high": 0.2}
    loss, metrics = total_loss(logp, logp.detach(), adv, mask, entropy_bt=entropy, entropy_coef=0.0, **kw)
    plain, _ = total_loss(logp, logp.detach(), adv, mask, **kw)
    assert metrics["entropy"] == pytest.approx(2.5, rel=1e-12)
    assert loss.item() == plain.item()
    loss.backward()
    assert entropy.grad is None and logp.grad is not None
    loss, _ = total_loss(logp, logp.detach(), adv, mask, entropy_bt=entropy, entropy_coef=0.1, **kw)
    loss.backward()
    assert entropy.grad is not None


# ---------------------------------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_loop_reference(seed: int, agg: AggMode) -> None:
    """Loss, gradient, vf_clip_frac and explained variance vs loops; float64 rtol 1e-10 / atol 1e-12."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        b, t = rng.randint(1, 5), rng.randint(1, 6)
        mask = _ragged_mask(rng, b, t)
        old = [[rng.gauss(0, 1) for _ in range(t)] for _ in range(b)]
        values = [[o + rng.gauss(0, 0.5) for o in row] for row in old]
        returns = [[rng.gauss(0, 1) for _ in range(t)] for _ in range(b)]
        clip = rng.choice([None, 0.2, rng.uniform(0, 1)])
        v = _tensor(values, mask, grad=True)
        loss, metrics = value_loss(
            v, _tensor(old, mask), _tensor(returns, mask), torch.tensor(mask), clip=clip, agg=agg
        )
        loss.backward()
        assert v.grad is not None
        weights = ref_weights(mask, agg)
        per_tok, grads, n_clip, resid, rets = [], [], 0, [], []
        for i, row in enumerate(mask):
            lrow, grow = [], []
            for j, m in enumerate(row):
                vv, r = values[i][j], returns[i][j]
                plain = (vv - r) ** 2
                clipped = (
                    (min(max(vv, old[i][j] - clip), old[i][j] + clip) - r) ** 2 if clip is not None else plain
                )
                active = bool(m) and clipped > plain
                n_clip += active
                lrow.append(0.5 * max(plain, clipped))
                grow.append(0.0 if active or not m else (vv - r) * weights[i][j])
                if m:
                    resid.append(r - vv)
                    rets.append(r)
            per_tok.append(lrow)
            grads.append(grow)
        what = f"trial {trial} clip={clip}"
        _assert_close(loss, ref_aggregate(per_tok, mask, agg), seed, what + " loss")
        _assert_close(v.grad, _flat(grads), seed, what + " grad")
        _assert_close(metrics["vf_clip_frac"], n_clip / len(rets) if rets else 0.0, seed, what + " clip frac")
        ev = 1.0 - _masked_var_loop(resid) / _masked_var_loop(rets) if len(rets) > 1 else 0.0
        _assert_close(
            metrics["explained_variance"], ev, seed, what + " explained variance", rtol=1e-9, atol=1e-10
        )


def test_explained_variance_perfect_and_constant() -> None:
    r = torch.tensor([[1.0, 2.0, 3.0]])
    m = torch.ones(1, 3)
    assert value_loss(r.clone(), r, r, m)[1]["explained_variance"] == 1.0
    assert value_loss(r, r, torch.ones(1, 3), m)[1]["explained_variance"] == 0.0  # Var[R] = 0: reported as 0


# ---------------------------------------------------------------------------------------------------
# KL in reward, total loss
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "k2", "low_var_kl"])
def test_kl_in_reward_matches_loop_reference(seed: int, kind: KLKind) -> None:
    """Outcome [b] and token [b, t] rewards; float64 rtol 1e-10 / atol 1e-12."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        b, t, coef = rng.randint(1, 4), rng.randint(1, 6), rng.uniform(0, 0.5)
        mask = [[1] * n + [0] * (t - n) for n in (rng.randint(0, t) for _ in range(b))]
        ref = [[rng.uniform(-8, 0) for _ in range(t)] for _ in range(b)]
        logp = [[r + _log_ratio(rng) for r in row] for row in ref]
        outcome = [rng.gauss(0, 1) for _ in range(b)]
        token = [[outcome[i] if j == sum(mask[i]) - 1 else 0.0 for j in range(t)] for i in range(b)]
        kl = [
            [ref_kl(logp[i][j], ref[i][j], kind) if mask[i][j] else 0.0 for j in range(t)] for i in range(b)
        ]
        want = [[token[i][j] - coef * kl[i][j] if mask[i][j] else 0.0 for j in range(t)] for i in range(b)]
        n_tok = sum(map(sum, mask))
        want_kl = sum(map(sum, kl)) / n_tok if n_tok else 0.0
        lp, rp, mt = _tensor(logp, mask), _tensor(ref, mask), torch.tensor(mask)
        for rewards in (torch.tensor(outcome, dtype=F64), _tensor(token, mask)):
            got, mean_kl = kl_in_reward(rewards, lp, rp, mt, coef, kind)
            what = f"trial {trial} rewards {tuple(rewards.shape)}"
            _assert_close(got, _flat(want), seed, what)
            _assert_close(mean_kl, want_kl, seed, what + " mean kl")


def test_total_loss_combines_the_terms(seed: int) -> None:
    """loss = pg + kl_coef * agg(k3) - ent_coef * agg(entropy), vs loops; float64 rtol 1e-10."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        case = _policy_case(rng)
        agg = rng.choice(AGG_MODES)
        ref = [[lp + rng.gauss(0, 0.3) for lp in row] for row in case.logp]
        ent = [[rng.uniform(0, 3) for _ in row] for row in case.logp]
        kl_coef, ent_coef = rng.uniform(0, 0.1), rng.uniform(0, 0.01)
        loss, metrics = total_loss(
            _tensor(case.logp, case.mask, grad=True), _tensor(case.old, case.mask), _tensor(case.adv, case.mask),
            torch.tensor(case.mask), clip_low=case.clip_low, clip_high=case.clip_high, dual_clip=case.dual_clip,
            agg=agg, ref_logp_bt=_tensor(ref, case.mask), kl_coef=kl_coef, kl_kind="k3",
            entropy_bt=_tensor(ent, case.mask), entropy_coef=ent_coef,
        )  # fmt: skip
        pg, _, pg_metrics = ref_policy(case, agg, "token")
        kl = ref_aggregate(
            [
                [ref_kl(a, b, "k3") for a, b in zip(lr, rr, strict=True)]
                for lr, rr in zip(case.logp, ref, strict=True)
            ],
            case.mask,
            agg,
        )
        entropy = ref_aggregate(ent, case.mask, agg)
        what = f"trial {trial} {agg}"
        _assert_close(loss, pg + kl_coef * kl - ent_coef * entropy, seed, what + " loss")
        for key, want in {"pg_loss": pg, "kl_loss": kl, "entropy": entropy, **pg_metrics}.items():
            _assert_close(metrics[key], want, seed, f"{what} {key}")
        assert metrics["loss"] == loss.item()


def test_total_loss_requires_its_inputs() -> None:
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logp"):
        total_loss(z, z, z, z, clip_low=0.2, clip_high=0.2, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        total_loss(z, z, z, z, clip_low=0.2, clip_high=0.2, entropy_coef=0.1)
    loss, metrics = total_loss(z, z, z, z, clip_low=0.2, clip_high=0.2)
    assert loss.item() == 0.0 and "kl_loss" not in metrics and "entropy" not in metrics
