"""algorithm.rollout_correction against independent float64 references written as plain Python loops.

Every factor (importance weight x mask) and every rc_* metric is recomputed here token by token with `math` from
the definitions in docs/rollout-correction.md, on ragged batches with NaN padding (a leak of padding fails the
comparison) and log-ratios wide enough that every clamp, band and threshold is crossed. Tolerances: factors
rel 1e-12, metrics rel 1e-10 / abs 1e-12 (float64 both sides; only the summation order differs). The weighted
policy loss is checked against test_losses' loop reference through the identity w * l(A) = l(w * A) for w >= 0
(the clipped surrogate and the dual clip are positively homogeneous in the advantage). Inputs are drawn from a
seed printed in every message; rerun a failure with RLBRIDGE_TEST_SEED=<seed>.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest
import torch

from rlbridge.algo import correction as C
from rlbridge.algo.losses import AggMode, RatioLevel, policy_loss
from rlbridge.algo.objective import LossInputs, make_loss_fn
from rlbridge.recipe.schema import GrpoCfg, HealthCfg, RolloutCorrectionCfg
from tests.unit.algo.test_losses import (
    AGG_MODES,
    F64,
    Grid,
    Mask,
    PolicyCase,
    _assert_close,
    _flat,
    _policy_case,
    _ragged_mask,
    _tensor,
    ref_policy,
    seed,  # noqa: F401 (the fixture)
)

FACTOR_RTOL, METRIC_RTOL, METRIC_ATOL = 1e-12, 1e-10, 1e-12
TRIALS = 20

CONFIGS: list[dict[str, Any]] = [
    {"weights": "token"},
    {"weights": "token", "clamp_high": None},
    {"weights": "token", "clamp_high": 1.3},
    {"weights": "sequence"},
    {"weights": "sequence", "clamp_high": None},
    {"mask_band": [0.5, 2.0]},
    {"mask_band": [0.0, 1.5]},
    {"mask_band": [0.7, 1.4], "mask_level": "sequence"},
    *(
        {"reject": {"divergence": d, "level": lv, "threshold": th}}
        for d, th in (("k1", 0.4), ("k2", 0.08), ("k3", 0.08))
        for lv in ("token", "sequence_mean", "sequence_max")
    ),
    {
        "weights": "token",
        "clamp_high": 2.0,
        "mask_band": [0.25, 4.0],
        "reject": {"divergence": "k3", "level": "sequence_max", "threshold": 0.5},
    },
    {"weights": "sequence", "clamp_high": 1.5, "mask_band": [0.5, 3.0], "mask_level": "sequence"},
]


def _ids(cfg: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()).replace(" ", "")


def _case(rng: random.Random) -> tuple[Grid, Grid, Mask]:
    """Trainer and rollout log-probs of a ragged batch: mostly small gaps, some large, a few beyond +-20."""
    b, t = rng.randint(1, 6), rng.randint(1, 7)
    trainer = [[rng.uniform(-6, 0) for _ in range(t)] for _ in range(b)]

    def gap() -> float:
        u = rng.random()
        return (
            0.0
            if u < 0.1
            else rng.gauss(0, 0.2)
            if u < 0.6
            else rng.gauss(0, 1.0)
            if u < 0.95
            else rng.uniform(-25, 25)
        )

    rollout = [[x - gap() for x in row] for row in trainer]
    return trainer, rollout, _ragged_mask(rng, b, t)


# ------------------------------------------------------------------------------------- loop references
def _clamp(x: float) -> float:
    return min(max(x, -20.0), 20.0)


def _div(lw: float, kind: str) -> float:
    if kind == "k1":
        return abs(lw)
    if kind == "k2":
        return 0.5 * lw * lw
    return max(math.exp(lw) - 1.0 - lw, 0.0)


def _seq_lw(trainer: Grid, rollout: Grid, mask: Mask, i: int) -> float:
    vals = [_clamp(trainer[i][j] - rollout[i][j]) for j in range(len(mask[i])) if mask[i][j]]
    return sum(vals) / len(vals) if vals else 0.0


def ref_keep(cfg: RolloutCorrectionCfg, trainer: Grid, rollout: Grid, mask: Mask) -> list[list[bool]]:
    out = []
    for i, row in enumerate(mask):
        seq_lw = _seq_lw(trainer, rollout, mask, i)
        divs = [
            _div(_clamp(trainer[i][j] - rollout[i][j]), cfg.reject.divergence) if cfg.reject else 0.0
            for j in range(len(row))
            if row[j]
        ]
        keep_row = []
        for j, m in enumerate(row):
            if not m:
                keep_row.append(False)
                continue
            lw = _clamp(trainer[i][j] - rollout[i][j])
            ok = True
            if cfg.mask_band is not None:
                low, high = cfg.mask_band
                ratio = math.exp(lw if cfg.mask_level == "token" else seq_lw)
                ok = low <= ratio <= high
            if cfg.reject is not None:
                thr = cfg.reject.threshold
                if cfg.reject.level == "token":
                    ok = ok and _div(lw, cfg.reject.divergence) <= thr
                elif cfg.reject.level == "sequence_mean":
                    ok = ok and sum(divs) / len(divs) <= thr
                else:
                    ok = ok and max(divs) <= thr
            keep_row.append(ok)
        out.append(keep_row)
    return out


def ref_factor(cfg: RolloutCorrectionCfg, trainer: Grid, rollout: Grid, mask: Mask) -> Grid:
    keep = ref_keep(cfg, trainer, rollout, mask)
    out = []
    for i, row in enumerate(mask):
        seq_w = math.exp(_seq_lw(trainer, rollout, mask, i))
        frow = []
        for j, m in enumerate(row):
            if not m or not keep[i][j]:
                frow.append(0.0)
                continue
            w = 1.0
            if cfg.weights != "none":
                w = math.exp(_clamp(trainer[i][j] - rollout[i][j])) if cfg.weights == "token" else seq_w
                if cfg.clamp_high is not None:
                    w = min(w, cfg.clamp_high)
            frow.append(w)
        out.append(frow)
    return out


def ref_metrics(cfg: RolloutCorrectionCfg, trainer: Grid, rollout: Grid, mask: Mask) -> dict[str, float]:
    seqs = [i for i, row in enumerate(mask) if any(row)]
    toks = [(i, j) for i, row in enumerate(mask) for j, m in enumerate(row) if m]
    if not toks:
        return dict.fromkeys(C.METRIC_KEYS, 0.0)
    lw = {(i, j): _clamp(trainer[i][j] - rollout[i][j]) for i, j in toks}
    seq_lw = {i: _seq_lw(trainer, rollout, mask, i) for i in seqs}
    units = (
        [math.exp(lw[k]) for k in toks]
        if cfg.weights in ("none", "token")
        else [math.exp(seq_lw[i]) for i in seqs]
    )
    n = len(units)
    mean = sum(units) / n
    keep = ref_keep(cfg, trainer, rollout, mask)
    band_units = [lw[k] for k in toks] if cfg.mask_level == "token" else [seq_lw[i] for i in seqs]
    low_frac = high_frac = 0.0
    if cfg.mask_band is not None:
        low, high = cfg.mask_band
        low_frac = sum(1 for u in band_units if math.exp(u) < low) / len(band_units)
        high_frac = sum(1 for u in band_units if math.exp(u) > high) / len(band_units)
    t_ppl = sum(-sum(trainer[i][j] for j, m in enumerate(mask[i]) if m) / sum(mask[i]) for i in seqs) / len(
        seqs
    )
    r_ppl = sum(-sum(rollout[i][j] for j, m in enumerate(mask[i]) if m) / sum(mask[i]) for i in seqs) / len(
        seqs
    )
    return {
        "rc_weight_mean": mean,
        "rc_weight_std": math.sqrt(sum((u - mean) ** 2 for u in units) / n),
        "rc_weight_min": min(units),
        "rc_weight_max": max(units),
        "rc_ess": sum(units) ** 2 / (n * sum(u * u for u in units)),
        "rc_clip_high_frac": (
            sum(1 for u in units if u > cfg.clamp_high) / n
            if cfg.weights != "none" and cfg.clamp_high is not None
            else 0.0
        ),
        "rc_mask_low_frac": low_frac,
        "rc_mask_high_frac": high_frac,
        "rc_masked_token_frac": sum(1 for i, j in toks if not keep[i][j]) / len(toks),
        "rc_masked_seq_frac": sum(1 for i in seqs if not any(keep[i])) / len(seqs),
        "rc_trainer_log_ppl": t_ppl,
        "rc_rollout_log_ppl": r_ppl,
        "rc_log_ppl_diff": t_ppl - r_ppl,
        "rc_kl_k3": sum(math.exp(lw[k]) - 1.0 - lw[k] for k in toks) / len(toks),
        "rc_chi2": sum(math.exp(2 * lw[k]) for k in toks) / len(toks) - 1.0,
    }


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_factor_matches_loop_reference(seed: int, cfg: dict[str, Any]) -> None:  # noqa: F811
    rc = RolloutCorrectionCfg.model_validate(cfg)
    rng = random.Random(seed)
    for trial in range(TRIALS):
        trainer, rollout, mask = _case(rng)
        got = C.loss_factor(rc, _tensor(trainer, mask), _tensor(rollout, mask), torch.tensor(mask))
        assert got is not None and got.dtype == F64
        _assert_close(
            got,
            _flat(ref_factor(rc, trainer, rollout, mask)),
            seed,
            f"trial {trial} factor",
            rtol=FACTOR_RTOL,
            atol=0.0,
        )


@pytest.mark.parametrize("cfg", [{}, *CONFIGS], ids=lambda c: _ids(c) or "defaults")
def test_metrics_match_loop_reference(seed: int, cfg: dict[str, Any]) -> None:  # noqa: F811
    rc = RolloutCorrectionCfg.model_validate(cfg)
    rng = random.Random(seed)
    for trial in range(TRIALS):
        trainer, rollout, mask = _case(rng)
        got = C.metrics(rc, _tensor(trainer, mask), _tensor(rollout, mask), torch.tensor(mask))
        want = ref_metrics(rc, trainer, rollout, mask)
        assert set(got) == set(want) == set(C.METRIC_KEYS)
        for key, value in want.items():
            _assert_close(got[key], value, seed, f"trial {trial} {key}", rtol=METRIC_RTOL, atol=METRIC_ATOL)


def test_metrics_hand_values() -> None:
    """Two sequences, weights e^0.5, e^-0.5 | e^1: token mean (e^.5 + e^-.5 + e) / 3, ESS, k3, chi2 by hand."""
    trainer = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[-1.5, -1.5], [-2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    m = C.metrics(RolloutCorrectionCfg(), trainer, rollout, mask)
    w = [math.exp(0.5), math.exp(-0.5), math.e]
    assert m["rc_weight_mean"] == pytest.approx(sum(w) / 3, rel=1e-14)
    assert m["rc_ess"] == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)), rel=1e-14)
    assert m["rc_kl_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in w) / 3, rel=1e-14)
    assert m["rc_chi2"] == pytest.approx(sum(x * x for x in w) / 3 - 1, rel=1e-14)
    assert m["rc_trainer_log_ppl"] == pytest.approx((1.5 + 1.0) / 2, rel=1e-14)
    assert m["rc_rollout_log_ppl"] == pytest.approx((1.5 + 2.0) / 2, rel=1e-14)
    seq = C.metrics(RolloutCorrectionCfg(weights="sequence"), trainer, rollout, mask)
    assert seq["rc_weight_min"] == pytest.approx(1.0) and seq["rc_weight_max"] == pytest.approx(math.e)


def test_defaults_change_nothing_and_agreement_is_neutral() -> None:
    """The default section gives no factor (the loss is bit-for-bit today's); equal log-probs give weight 1, ESS 1,
    k3 = chi2 = 0 and nothing masked, whatever the settings."""
    assert (
        C.loss_factor(RolloutCorrectionCfg(), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)) is None
    )
    lp = -torch.rand(3, 4, dtype=F64)
    mask = torch.ones(3, 4)
    for cfg in CONFIGS:
        rc = RolloutCorrectionCfg.model_validate(cfg)
        f = C.loss_factor(rc, lp, lp, mask)
        assert f is not None and torch.equal(f, torch.ones_like(f)), cfg
        m = C.metrics(rc, lp, lp, mask)
        assert (m["rc_weight_mean"], m["rc_ess"], m["rc_kl_k3"], m["rc_chi2"], m["rc_masked_token_frac"]) == (
            1,
            1,
            0,
            0,
            0,
        )


def test_empty_batch_metrics_are_zero() -> None:
    m = C.metrics(
        RolloutCorrectionCfg(weights="token"), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)
    )
    assert m == dict.fromkeys(C.METRIC_KEYS, 0.0)


# ------------------------------------------------------------------------- the weighted policy loss
def _weighted_case(rng: random.Random) -> tuple[PolicyCase, Grid]:
    case = _policy_case(rng)
    w = [[rng.choice([0.0, 1.0, rng.uniform(0, 3), rng.uniform(0, 3)]) for _ in row] for row in case.mask]
    return case, w


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_weighted_policy_loss_matches_loop_reference(seed: int, agg: AggMode, level: RatioLevel) -> None:  # noqa: F811
    """weight_bt multiplies the clipped (and dual-clipped) per-token loss: loss and gradient equal the loop
    reference with advantages w * A (rel 1e-10); the clip metrics are those of the unweighted loss."""
    rng = random.Random(seed)
    for trial in range(TRIALS):
        case, w = _weighted_case(rng)
        logp = _tensor(case.logp, case.mask, grad=True)
        loss, metrics = policy_loss(
            logp, _tensor(case.old, case.mask), _tensor(case.adv, case.mask), torch.tensor(case.mask),
            clip_low=case.clip_low, clip_high=case.clip_high, dual_clip=case.dual_clip, agg=agg, level=level,
            weight_bt=_tensor(w, case.mask),
        )  # fmt: skip
        loss.backward()
        assert logp.grad is not None
        scaled = PolicyCase(
            case.old,
            case.logp,
            [[a * x for a, x in zip(ar, wr, strict=True)] for ar, wr in zip(case.adv, w, strict=True)],
            case.mask,
            case.clip_low,
            case.clip_high,
            case.dual_clip,
        )
        want_loss, want_grad, _ = ref_policy(scaled, agg, level)
        _, _, want_metrics = ref_policy(case, agg, level)
        what = f"trial {trial} {agg} {level}"
        _assert_close(loss, want_loss, seed, what + " loss")
        _assert_close(logp.grad, _flat(want_grad), seed, what + " grad")
        for key, value in want_metrics.items():
            _assert_close(metrics[key], value, seed, f"{what} {key}")


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("on_policy", [True, False])
def test_loss_closure_weights_each_micro_batch_exactly(mode: str, on_policy: bool) -> None:
    """make_loss_fn with a correction: micro-batch shares still sum to the full-batch loss (rel 1e-12), and the full
    batch equals policy_loss with the reference factor (trainer log-probs: old, or the live ones on policy)."""
    rng = random.Random(7)
    trainer, rollout, mask_l = _case(rng)
    while sum(map(sum, mask_l)) < 4 or len(mask_l) < 4:
        trainer, rollout, mask_l = _case(rng)
    mask = torch.tensor(mask_l, dtype=F64)
    b = mask.shape[0]
    logp = torch.where(
        mask > 0, torch.tensor(trainer, dtype=F64) + 0.03 * torch.randn(mask.shape, dtype=F64), 0.0
    )
    adv = torch.randn(mask.shape, dtype=F64) * mask
    old = None if on_policy else torch.where(mask > 0, torch.tensor(trainer, dtype=F64), 0.0)
    roll = torch.where(mask > 0, torch.tensor(rollout, dtype=F64), 0.0)
    cfg = {
        "weights": "token",
        "mask_band": [0.3, 3.0],
        "reject": {"divergence": "k3", "level": "sequence_max", "threshold": 1.0},
    }
    algo = GrpoCfg.model_validate({"loss_agg": mode, "rollout_correction": cfg})
    fn = make_loss_fn(algo, LossInputs(adv, mask, old, None, roll), norm_constant=9.0)
    full = fn(logp, torch.zeros_like(logp), torch.arange(b))[0]
    parts = sum(fn(logp[r], torch.zeros_like(logp[r]), r)[0] for r in torch.arange(b).tensor_split(min(b, 3)))
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-15)
    trainer_lp = logp if on_policy else old
    assert trainer_lp is not None
    factor = ref_factor(algo.rollout_correction, trainer_lp.tolist(), roll.tolist(), mask_l)
    want, _ = policy_loss(
        logp,
        logp if old is None else old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        agg=mode,  # type: ignore[arg-type]
        weight_bt=torch.tensor(factor, dtype=F64),
    )
    if mode == "seq-mean-token-sum-norm":
        want = want * mask.shape[1] / 9.0
    torch.testing.assert_close(full, want, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------- health
def test_health_problems_name_the_key() -> None:
    h = HealthCfg()
    assert C.health_problems(h, {"rc_weight_mean": 1.0, "rc_ess": 0.9}) == []
    assert C.health_problems(h, {}) == []
    low = C.health_problems(h, {"rc_weight_mean": 0.4, "rc_ess": 0.9})
    assert len(low) == 1 and "run.health.is_weight_range" in low[0]
    both = C.health_problems(h, {"rc_weight_mean": 2.5, "rc_ess": 0.2})
    assert len(both) == 2 and "run.health.min_ess" in both[1]
    assert (
        C.health_problems(
            HealthCfg(is_weight_range=(0.1, 10.0), min_ess=0.1), {"rc_weight_mean": 2.5, "rc_ess": 0.2}
        )
        == []
    )


def test_loop_warns_by_default_and_stops_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    from rlbridge.errors import RlbridgeError
    from rlbridge.health import check_mismatch
    from rlbridge.recipe.schema import Recipe

    def recipe(**health: Any) -> Recipe:
        return Recipe.model_validate(
            {
                "name": "t",
                "model": {"path": "x"},
                "reward": {"fn": "arithmetic"},
                "data": {"train": {"path": "builtin:arithmetic"}},
                "run": {"health": health},
            }
        )

    bad = {"rc_weight_mean": 3.0, "rc_ess": 0.9}
    check_mismatch(recipe(), {"rc_weight_mean": 1.0, "rc_ess": 0.9}, 1)
    check_mismatch(recipe(), bad, 2)
    assert "step 2" in capsys.readouterr().err
    with pytest.raises(RlbridgeError, match="on_mismatch"):
        check_mismatch(recipe(on_mismatch="stop"), bad, 3)


# ---------------------------------------------------------------------------------------- the recipe
RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    ("sets", "key", "fragment"),
    [
        ([f"{RC}.bypass=true", f"{RC}.weights=token"], f"{RC}.weights", "bypass takes the old log-probs"),
        (
            [f"{RC}.bypass=true", f"{RC}.mask_band=[0.5,2]"],
            f"{RC}.mask_band",
            "set algorithm.rollout_correction.bypass: false",
        ),
        ([f"{RC}.bypass=true", f"{RC}.reject.threshold=0.1"], f"{RC}.reject", "bypass"),
        ([f"{RC}.clamp_high=3"], f"{RC}.clamp_high", "weights is none"),
        ([f"{RC}.mask_level=sequence"], f"{RC}.mask_level", "no mask_band"),
        ([f"{RC}.mask_band=[1.1,2]"], f"{RC}.mask_band", "low < 1 < high"),
        (
            [f"{RC}.weights=token", f"{RC}.clamp_high=3", f"{RC}.mask_band=[0.5,2]"],
            f"{RC}.clamp_high",
            "below 2",
        ),
        ([f"{RC}.weights=tokens"], f"{RC}.weights", "token"),
        ([f"{RC}.reject.divergence=k3"], f"{RC}.reject.threshold", ""),
        ([f"{RC}.clamp_high=0.5", f"{RC}.weights=token"], f"{RC}.clamp_high", ""),
        (["run.health.is_weight_range=[1.2,2]"], "run.health.is_weight_range", "[0.5, 2.0]"),
    ],
)
def test_recipe_rejects_contradictions_with_a_fix(
    tmp_path: Any, sets: list[str], key: str, fragment: str
) -> None:
    from rlbridge.errors import RecipeError
    from rlbridge.recipe import validate_recipe

    f = tmp_path / "r.yaml"
    f.write_text(
        "name: t\nmodel: {path: x}\ndata: {train: {path: 'builtin:arithmetic'}}\nreward: {fn: arithmetic}\nalgorithm: {name: grpo}\n"
    )
    with pytest.raises(RecipeError) as e:
        validate_recipe(f, sets, model_checks=False)
    found = [i for i in e.value.issues if i.key == key]
    assert found, [str(i) for i in e.value.issues]
    assert fragment in f"{found[0].message} {found[0].fix}", str(found[0])


@pytest.mark.parametrize(
    "sets",
    [
        [],
        [f"{RC}.weights=token"],
        [
            f"{RC}.weights=sequence",
            f"{RC}.clamp_high=null",
            f"{RC}.mask_band=[0.5,2.0]",
            f"{RC}.mask_level=sequence",
        ],
        [f"{RC}.reject.divergence=k1", f"{RC}.reject.level=sequence_max", f"{RC}.reject.threshold=0.5"],
        [f"{RC}.bypass=true"],
        ["run.health.on_mismatch=stop", "run.health.min_ess=0.5", "run.health.is_weight_range=[0.8,1.25]"],
    ],
)
def test_recipe_accepts_the_documented_settings(tmp_path: Any, sets: list[str]) -> None:
    from rlbridge.recipe import validate_recipe

    f = tmp_path / "r.yaml"
    f.write_text(
        "name: t\nmodel: {path: x}\ndata: {train: {path: 'builtin:arithmetic'}}\nreward: {fn: arithmetic}\nalgorithm: {name: grpo}\n"
    )
    validate_recipe(f, sets, model_checks=False)


def test_a_lasting_gap_is_warned_once_then_every_tenth_step_and_its_end_told(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rlbridge.algo.correction import MismatchNotices
    from rlbridge.health import check_mismatch
    from rlbridge.recipe.schema import Recipe

    r = Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": "x"},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}},
        }
    )
    bad, good = {"rc_weight_mean": 3.0, "rc_ess": 0.9}, {"rc_weight_mean": 1.0, "rc_ess": 0.9}
    notices = MismatchNotices()
    for step in range(1, 26):
        check_mismatch(r, bad if 3 <= step <= 23 else good, step, notices)
    text = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert re.findall(r"step (\d+):", text) == ["3", "13", "23", "24"], text
    assert "step 3: rollout and trainer disagree: mean importance weight 3" in text
    assert "step 13: rollout and trainer still disagree (since step 3)" in text
    assert (
        "step 24: the importance weights are back within run.health's limits (outside since step 3)" in text
    )
