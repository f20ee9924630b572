"""Every row of docs/migrating-from-verl.md's formula table, checked numerically.

For each row the test re-implements verl's definition (``verl/trainer/ppo/core_algos.py`` and the masked
statistics of ``verl/utils/torch_functional.py``) in float64, following verl's code line by line but written
here (verl is not imported), and checks what the row claims: "none" means rlbridge's function gives the same
values (and gradients, for losses) on small random tensors; a "differs" row checks the stated difference,
in both directions where it has two. A row added to the page without a check here fails
``test_every_row_has_a_check``.
"""

# ruff: noqa: B023  (every lambda below is called at once, in the loop iteration that made it)

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest
import torch
from torch import Tensor

from rlbridge.algo import advantages as A
from rlbridge.algo import losses as L
from rlbridge.algo import objective
from rlbridge.algo.kl_control import AdaptiveKlController
from rlbridge.recipe.schema import DrGrpoCfg, GrpoCfg, KlCfg, RolloutCfg

F64 = torch.float64
PAGE = Path(__file__).resolve().parents[3] / "docs" / "migrating-from-verl.md"
SECTION = "## Loss and advantage formulas against verl's `core_algos.py`"


def table_rows() -> list[str]:
    """The first cell of every row of the page's formula table."""
    text = PAGE.read_text()
    assert SECTION in text, f"{PAGE.name} lost its section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| ")]
    return [r.split(" | ")[0][2:].strip() for r in rows[1:]]  # skip the header (the --- line has no "| ")


# ------------------------------------------------------------------------------------------------
# verl's definitions, re-implemented (float64, as in verl's source)
# ------------------------------------------------------------------------------------------------


def v_masked_sum(x: Tensor, m: Tensor, axis: int | None = None) -> Tensor:
    return (x * m).sum() if axis is None else (x * m).sum(axis)


def v_masked_mean(x: Tensor, m: Tensor, axis: int | None = None) -> Tensor:
    return v_masked_sum(x, m, axis) / ((m.sum() if axis is None else m.sum(axis)) + 1e-8)


def v_masked_var(x: Tensor, m: Tensor) -> Tensor:
    mean = v_masked_mean(x, m)
    var = v_masked_mean((x - mean) ** 2, m)
    n = m.sum()
    return var * n / (n - 1)


def v_masked_whiten(x: Tensor, m: Tensor) -> Tensor:
    return (x - v_masked_mean(x, m)) * torch.rsqrt(v_masked_var(x, m) + 1e-8)


def v_agg_loss(loss_mat: Tensor, m: Tensor, mode: str, loss_scale_factor: float | None = None) -> Tensor:
    if mode == "token-mean":
        return v_masked_sum(loss_mat, m) / m.sum()
    if mode == "seq-mean-token-sum":
        seq_losses = (loss_mat * m).sum(-1)
        seq_mask = (m.sum(-1) > 0).to(F64)
        return v_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        count = m.sum(-1)
        seq_losses = (loss_mat * m).sum(-1) / (count + 1e-8)
        seq_mask = (count > 0).to(F64)
        return v_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":
        seq_losses = (loss_mat * m).sum(-1)
        return seq_losses.sum() / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    raise ValueError(mode)


def v_policy_loss_vanilla(
    old: Tensor,
    logp: Tensor,
    adv: Tensor,
    m: Tensor,
    low: float,
    high: float,
    c: float,
    mode: str,
    loss_scale_factor: float | None = None,
) -> Tensor:
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.min(-adv * c, clip1)
    return v_agg_loss(torch.where(adv < 0, clip2, clip1), m, mode, loss_scale_factor)


def v_policy_loss_gspo(old: Tensor, logp: Tensor, adv: Tensor, m: Tensor, low: float, high: float) -> Tensor:
    neg_kl = logp - old
    seq_kl = (neg_kl * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_ratio = logp - logp.detach() + seq_kl.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    return v_agg_loss(pg, m, "seq-mean-token-mean")


def v_kl_penalty(logp: Tensor, ref: Tensor, kind: str) -> Tensor:
    if kind in ("kl", "k1"):
        return logp - ref
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref).square()
    kl = torch.clamp(ref - logp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def v_entropy_from_logits(logits: Tensor) -> Tensor:
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(-1)


def v_value_loss(vpreds: Tensor, returns: Tensor, values: Tensor, m: Tensor, c: float, mode: str) -> Tensor:
    clipped = torch.max(torch.min(vpreds, values + c), values - c)
    return 0.5 * v_agg_loss(torch.max((vpreds - returns) ** 2, (clipped - returns) ** 2), m, mode)


def v_grpo(scores: Tensor, index: list[int], norm_std: bool, eps: float = 1e-6) -> Tensor:
    by_id: dict[int, list[Tensor]] = defaultdict(list)
    for i, s in enumerate(scores):
        by_id[index[i]].append(s)
    mean, std = {}, {}
    for k, v in by_id.items():
        if len(v) == 1:
            mean[k], std[k] = torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64)
        else:
            mean[k], std[k] = torch.stack(v).mean(), torch.stack(v).std()
    out = scores.clone()
    for i in range(len(scores)):
        out[i] = (
            (scores[i] - mean[index[i]]) / (std[index[i]] + eps) if norm_std else scores[i] - mean[index[i]]
        )
    return out


def v_rloo(scores: Tensor, index: list[int]) -> Tensor:
    by_id: dict[int, list[Tensor]] = defaultdict(list)
    for i, s in enumerate(scores):
        by_id[index[i]].append(s)
    out = scores.clone()
    for i in range(len(scores)):
        n = len(by_id[index[i]])
        mean = torch.stack(by_id[index[i]]).mean()
        out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out


def v_reinforce_pp(token_rewards: Tensor, m: Tensor, gamma: float) -> Tensor:
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * m[:, t]
    return v_masked_whiten(returns, m) * m


def v_reinforce_pp_baseline(token_rewards: Tensor, m: Tensor, index: list[int]) -> Tensor:
    scores = token_rewards.sum(-1)
    by_id: dict[int, list[Tensor]] = defaultdict(list)
    for i, s in enumerate(scores):
        by_id[index[i]].append(s)
    scores = torch.stack([scores[i] - torch.stack(by_id[index[i]]).mean() for i in range(len(scores))])
    tiled = scores.unsqueeze(-1).tile([1, token_rewards.shape[1]]) * m
    return v_masked_whiten(tiled, m) * m


def v_gae(rewards: Tensor, values: Tensor, m: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    nextvalues: Tensor | float = 0.0
    lastgaelam: Tensor | float = 0.0
    rev = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    return v_masked_whiten(adv, m), adv + values


def v_adaptive_kl(value: float, target: float, horizon: int, current_kl: float, n_steps: int) -> float:
    error = min(max(current_kl / target - 1, -0.2), 0.2)
    return value * (1 + error * n_steps / horizon)


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mask(b: int, t: int, g: torch.Generator, *, empty_row: bool = False) -> Tensor:
    """Right-padded 0/1 float64 mask with lengths in [1, t] (one all-zero row with ``empty_row``)."""
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if empty_row:
        lengths[1] = 0
    return (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)


def logps(b: int, t: int, g: torch.Generator, spread: float = 0.4) -> tuple[Tensor, Tensor]:
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    return old + spread * torch.randn(b, t, generator=g, dtype=F64), old


def grad_of(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    (grad,) = torch.autograd.grad(out, x)
    return out.detach(), grad


def close(a: Tensor, b: Tensor, rtol: float = 1e-7, atol: float = 1e-10) -> None:
    """float64 agreement; 1e-7 leaves room for the 1e-8 verl adds to every count of a masked mean (a relative
    1e-8 / count), far below any difference a row documents."""
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


SEEDS = [0, 1, 2]

# ------------------------------------------------------------------------------------------------
# one check per row
# ------------------------------------------------------------------------------------------------


def agg_same(mode: L.AggMode, rtol: float) -> Callable[[], None]:
    def check() -> None:
        for seed in SEEDS:
            g = gen(seed)
            m = mask(6, 9, g, empty_row=mode != "token-mean")
            x = torch.randn(6, 9, generator=g, dtype=F64)
            close(L.aggregate(x, m, mode), v_agg_loss(x, m, mode), rtol=rtol)

    return check


def check_sum_norm() -> None:
    """rlbridge = verl / number of sequences, for one batch; over micro-batches verl's FSDP actor (each
    micro-batch x 1 / gradient accumulation) = rlbridge's make_loss_fn x sequences per micro-batch."""
    for seed in SEEDS:
        g = gen(seed)
        m = mask(8, 7, g)
        x = torch.randn(8, 7, generator=g, dtype=F64)
        ours = L.aggregate(x, m, "seq-mean-token-sum-norm", norm_constant=12.0)
        verl = v_agg_loss(x, m, "seq-mean-token-sum-norm", loss_scale_factor=12.0)
        close(ours * 8, verl)
        assert not torch.isclose(ours, verl), "the factor of 8 sequences must show"
        # the whole mini-batch through rlbridge's micro-batched closure vs verl's dp_actor accumulation
        logp, old = logps(8, 7, g)
        adv = torch.randn(8, 7, generator=g, dtype=F64).abs()  # A >= 0: verl's dual clip stays idle
        algo = DrGrpoCfg(name="dr_grpo")
        inputs = objective.LossInputs(adv, m, old, None, None)
        fn = objective.make_loss_fn(algo, inputs, norm_constant=12.0)
        zeros = torch.zeros(8, 7, dtype=F64)
        micro, num_micro = 2, 4
        ours_total = sum(fn(logp[r], zeros[r], r)[0] for r in torch.arange(8).split(micro))
        verl_total = sum(
            v_policy_loss_vanilla(
                old[r], logp[r], adv[r], m[r], 0.2, 0.2, 3.0, "seq-mean-token-sum-norm", 12.0
            )
            / num_micro
            for r in torch.arange(8).split(micro)
        )
        close(torch.as_tensor(ours_total) * micro, torch.as_tensor(verl_total))


def check_vanilla() -> None:
    for seed in SEEDS:
        for mode in ("token-mean", "seq-mean-token-mean"):
            g = gen(seed)
            m = mask(6, 8, g)
            logp, old = logps(6, 8, g, spread=1.5)
            adv = torch.randn(6, 8, generator=g, dtype=F64) * 2
            logp[0, 0] = old[0, 0] + 25.0  # beyond the [-20, 20] clamp
            ours = grad_of(
                lambda lp: L.policy_loss(
                    lp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=mode
                )[0],
                logp,
            )
            verl = grad_of(lambda lp: v_policy_loss_vanilla(old, lp, adv, m, 0.2, 0.28, 3.0, mode), logp)
            close(ours[0], verl[0])
            close(ours[1], verl[1] * m)  # padded tokens: verl's grad is 0 through the agg's mask as well


def check_gspo() -> None:
    for seed in SEEDS:
        g = gen(seed)
        m = mask(6, 8, g)
        logp, old = logps(6, 8, g, spread=0.01)
        adv = torch.randn(6, 8, generator=g, dtype=F64)
        adv = adv[:, :1].expand(6, 8).contiguous()  # one advantage per sequence

        def ours_fn(lp: Tensor) -> Tensor:
            return L.policy_loss(lp, old, adv, m, clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean",
                                 level="sequence")[0]  # fmt: skip

        def verl_fn(lp: Tensor) -> Tensor:
            return v_policy_loss_gspo(old, lp, adv, m, 3e-4, 4e-4)

        # below a mean log-ratio of 10: the same values and gradients
        ours, verl = grad_of(ours_fn, logp), grad_of(verl_fn, logp)
        close(ours[0], verl[0])
        close(ours[1], verl[1] * m)
        # sequence 0 with a mean log-ratio of 12 and a negative advantage: verl caps it at exp(10) and gives
        # it no gradient; rlbridge keeps exp(12) and a gradient on each of its tokens
        logp_hi = logp.clone()
        logp_hi[0] = old[0] + 12.0
        adv_neg = adv.clone()
        adv_neg[0] = -1.0
        ours = grad_of(lambda lp: L.policy_loss(lp, old, adv_neg, m, clip_low=3e-4, clip_high=4e-4,
                                                agg="seq-mean-token-mean", level="sequence")[0], logp_hi)  # fmt: skip
        verl = grad_of(lambda lp: v_policy_loss_gspo(old, lp, adv_neg, m, 3e-4, 4e-4), logp_hi)
        assert torch.all(verl[1][0] == 0) and torch.all(ours[1][0][m[0] > 0] != 0)
        n = m.shape[0]
        close((ours[0] - verl[0]) * n, torch.tensor(math.exp(12.0) - math.exp(10.0), dtype=F64))
        close(ours[1][1:], verl[1][1:] * m[1:])  # the other sequences are unchanged


def kl_same(kinds: tuple[str, ...], ours_kind: L.KLKind) -> Callable[[], None]:
    def check() -> None:
        for seed in SEEDS:
            g = gen(seed)
            logp, ref = logps(5, 7, g, spread=3.0)
            logp[0, :3] = ref[0, :3] + torch.tensor([25.0, -25.0, -5.0], dtype=F64)  # both clamps
            for kind in kinds:
                ours = grad_of(lambda lp: L.kl_estimate(lp, ref, ours_kind).sum(), logp)
                verl = grad_of(lambda lp: v_kl_penalty(lp, ref, kind).sum(), logp)
                close(ours[0], verl[0])
                close(ours[1], verl[1])

    return check


def check_kl_refused() -> None:
    for kind in ("k1+", "k3+", "low_var_kl+", "abs", "full"):
        with pytest.raises(pydantic.ValidationError):
            KlCfg(estimator=kind)  # type: ignore[arg-type]  # the refusal is what is checked


def check_entropy() -> None:
    for seed in SEEDS:
        g = gen(seed)
        m = mask(4, 6, g)
        logits = torch.randn(4, 6, 11, generator=g, dtype=F64) * 3
        ent = L.entropy_from_logits(logits)
        close(ent, v_entropy_from_logits(logits))
        for mode in ("token-mean", "seq-mean-token-sum"):
            close(L.entropy_bonus(ent, m, 0.01, mode), -0.01 * v_agg_loss(ent, m, mode))


def check_value() -> None:
    for seed in SEEDS:
        g = gen(seed)
        m = mask(5, 6, g)
        values, old, returns = (torch.randn(5, 6, generator=g, dtype=F64) for _ in range(3))
        ours = grad_of(lambda v: L.value_loss(v, old, returns, m, clip=0.2)[0], values)
        verl = grad_of(lambda v: v_value_loss(v, returns, old, m, 0.2, "token-mean"), values)
        close(ours[0], verl[0])
        close(ours[1], verl[1])


def check_grpo() -> None:
    for seed in SEEDS:
        g = gen(seed)
        scores = torch.randint(0, 3, (12,), generator=g).to(F64) / 2
        scores[:4] = 0.5  # one group of equal rewards
        index = [i // 4 for i in range(12)]
        for norm_std in (True, False):
            close(A.grpo_advantages(scores, 4, norm_std=norm_std), v_grpo(scores, index, norm_std))
    with pytest.raises(ValueError, match="group_size"):
        A.grpo_advantages(torch.ones(3, dtype=F64), 1)  # verl: r / (1 + eps); refused here


def check_rloo() -> None:
    for seed in SEEDS:
        scores = torch.randn(12, generator=gen(seed), dtype=F64)
        close(A.rloo_advantages(scores, 3), v_rloo(scores, [i // 3 for i in range(12)]))


def check_reinforce_pp() -> None:
    for seed in SEEDS:
        g = gen(seed)
        m = mask(8, 6, g)
        scores = torch.randn(8, generator=g, dtype=F64)
        ours = A.reinforce_pp_advantages(scores, m)
        close(ours, v_reinforce_pp(A.outcome_to_token_rewards(scores, m), m, gamma=1.0))


def check_reinforce_pp_baseline() -> None:
    for seed in SEEDS:
        g = gen(seed)
        m = mask(8, 6, g)
        scores = torch.randn(8, generator=g, dtype=F64)
        ours = A.reinforce_pp_advantages(scores, m, group_size=4, baseline=True)
        verl = v_reinforce_pp_baseline(A.outcome_to_token_rewards(scores, m), m, [i // 4 for i in range(8)])
        close(ours, verl)


def check_gae() -> None:
    for seed in SEEDS:
        g = gen(seed)
        m = mask(5, 7, g)
        rewards, values = torch.randn(5, 7, generator=g, dtype=F64), torch.randn(5, 7, generator=g, dtype=F64)
        adv, ret = A.gae(rewards, values, m, gamma=0.99, lam=0.95)
        v_adv, v_ret = v_gae(rewards * m, values * m, m, 0.99, 0.95)
        close(A.masked_whiten(adv, m), v_adv * m)
        close(ret, v_ret * m)


def check_kl_in_reward() -> None:
    for seed in SEEDS:
        g = gen(seed)
        m = mask(5, 7, g)
        logp, ref = logps(5, 7, g)
        scores = torch.randn(5, generator=g, dtype=F64)
        token_scores = A.outcome_to_token_rewards(scores, m)
        for kind in ("k1", "low_var_kl"):
            ours, _ = L.kl_in_reward(scores, logp, ref, m, 0.05, kind)  # type: ignore[arg-type]
            close(ours, (token_scores - 0.05 * v_kl_penalty(logp, ref, kind) * m) * m)


def check_adaptive_kl() -> None:
    for kl in (0.01, 0.05, 0.3, 5.0):
        ctl = AdaptiveKlController(coef=0.1, target=0.06, horizon=10000)
        assert ctl.update(kl, 64) == pytest.approx(v_adaptive_kl(0.1, 0.06, 10000, kl, 64), rel=1e-15)
    # the input: rlbridge's kl_seq_mean is the mean of summed KL; verl's current_kl the mean of token means
    g = gen(0)
    m = mask(8, 6, g)
    logp, ref = logps(8, 6, g)
    algo = GrpoCfg(kl=KlCfg(coef=0.1, where="reward", estimator="k1"))
    out = objective.compute_advantages(algo, RolloutCfg(n=4), torch.randn(8, dtype=F64), m, logp_bt=logp,
                                       ref_logp_bt=ref)  # fmt: skip
    kld = v_kl_penalty(logp, ref, "k1") * m
    assert out.kl_seq_mean == pytest.approx(float(kld.sum(-1).mean()), rel=1e-9)
    verl_kl = float(v_masked_mean(kld, m, axis=-1).mean())
    assert out.kl_seq_mean != pytest.approx(verl_kl, rel=1e-3)


CHECKS: dict[str, Callable[[], None]] = {
    "`agg_loss` `token-mean`": agg_same("token-mean", 1e-9),
    "`agg_loss` `seq-mean-token-sum`": agg_same("seq-mean-token-sum", 1e-9),
    "`agg_loss` `seq-mean-token-mean`": agg_same("seq-mean-token-mean", 1e-7),
    "`agg_loss` `seq-mean-token-sum-norm`": check_sum_norm,
    "`compute_policy_loss_vanilla`": check_vanilla,
    "`compute_policy_loss_gspo`": check_gspo,
    "`kl_penalty` `kl` / `k1`": kl_same(("kl", "k1"), "k1"),
    "`kl_penalty` `mse` / `k2`": kl_same(("mse", "k2"), "k2"),
    "`kl_penalty` `low_var_kl` / `k3`": kl_same(("low_var_kl", "k3"), "low_var_kl"),
    "`kl_penalty` `k1+`, `k3+`, `low_var_kl+`, `abs`, `full`": check_kl_refused,
    "`compute_entropy_loss` with `entropy_coeff`": check_entropy,
    "`compute_value_loss`": check_value,
    "`compute_grpo_outcome_advantage`": check_grpo,
    "`compute_rloo_outcome_advantage`": check_rloo,
    "`compute_reinforce_plus_plus_outcome_advantage`": check_reinforce_pp,
    "`compute_reinforce_plus_plus_baseline_outcome_advantage`": check_reinforce_pp_baseline,
    "`compute_gae_advantage_return`": check_gae,
    "`compute_rewards` / `apply_kl_penalty` (`use_kl_in_reward`)": check_kl_in_reward,
    "`AdaptiveKLController.update`": check_adaptive_kl,
}


def test_every_row_has_a_check() -> None:
    rows = table_rows()
    assert len(rows) == len(set(rows)), rows
    assert set(rows) == set(CHECKS), (
        f"rows without a check: {sorted(set(rows) - set(CHECKS))}; checks without a row: "
        f"{sorted(set(CHECKS) - set(rows))}"
    )


@pytest.mark.parametrize("row", list(CHECKS))
def test_row(row: str) -> None:
    CHECKS[row]()


def test_a_wrong_reference_fails() -> None:
    """Negative control: the comparison catches a factor that the sum-norm row documents."""
    g = gen(0)
    m = mask(4, 5, g)
    x = torch.randn(4, 5, generator=g, dtype=F64)
    with pytest.raises(AssertionError):
        close(L.aggregate(x, m, "seq-mean-token-sum-norm"), v_agg_loss(x, m, "seq-mean-token-sum-norm"))


def test_page_rows_name_real_functions() -> None:
    """The rlbridge column names functions that exist (``module.function``)."""
    text = PAGE.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    modules = {"losses": L, "advantages": A, "objective": objective}
    for ref in re.findall(r"`(losses|advantages|objective)\.(\w+)`", text):
        assert hasattr(modules[ref[0]], ref[1]), ref
