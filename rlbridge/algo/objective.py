"""The recipe's `algorithm` section turned into numbers: advantages per sequence/token and the loss closure.

The pure functions in advantages.py / losses.py know nothing of recipes; this module picks and wires
them per `algorithm.name`, and makes micro-batching exact: a loss aggregated over a whole mini-batch
(token-mean, seq-mean, ...) is split into per-micro-batch pieces whose sum equals the full-batch value,
so gradient accumulation gives the same update as one big batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlbridge.algo import advantages as A
from rlbridge.algo import correction as C
from rlbridge.algo import losses as L
from rlbridge.batch import LossFn, ValueLossFn
from rlbridge.recipe.schema import AlgorithmCfg, CriticCfg, PpoCfg, RolloutCfg


@dataclass
class StepAdvantages:
    adv_bt: Tensor
    """[b, R] advantages per response token (0 on padding)."""
    token_rewards_bt: Tensor | None
    """Token rewards after the KL penalty (with kl.where == reward), or PPO's token rewards."""
    metrics: dict[str, float]
    old_values_bt: Tensor | None = None
    """PPO: the critic's values before the update, [b, R] (the value clip's centre)."""
    returns_bt: Tensor | None = None
    """PPO: GAE returns (advantages + old values, before whitening), the critic's targets, [b, R]."""
    kl_seq_mean: float | None = None
    """Mean over sequences of the summed KL estimate (with kl.where == reward): the adaptive KL controller's input."""


def compute_advantages(
    algo: AlgorithmCfg,
    rollout: RolloutCfg,
    rewards_b: Tensor,
    mask_bt: Tensor,
    *,
    logp_bt: Tensor | None = None,
    ref_logp_bt: Tensor | None = None,
    values_bt: Tensor | None = None,
    kl_coef: float | None = None,
) -> StepAdvantages:
    """Advantages for every algorithm. PPO needs the critic's values of the response tokens (`values_bt`,
    see ppo_advantages). `kl_coef` replaces algorithm.kl.coef in the reward (the adaptive KL controller's
    current value)."""
    n = rollout.n
    metrics: dict[str, float] = {}
    rewards_b = rewards_b.to(
        torch.float32 if values_bt is None else values_bt.dtype
    )  # PPO: the critic's dtype
    token_rewards_bt: Tensor | None = None
    kl_seq: float | None = None
    if algo.kl.where == "reward" and algo.kl.coef > 0:
        if logp_bt is None or ref_logp_bt is None:
            raise ValueError("kl.where == reward needs policy and reference log-probs")
        coef = algo.kl.coef if kl_coef is None else kl_coef
        token_rewards_bt, kl_mean = L.kl_in_reward(
            rewards_b, logp_bt, ref_logp_bt, mask_bt, coef, algo.kl.estimator
        )
        kl_seq = float(
            A.masked_sum(L.kl_estimate(logp_bt, ref_logp_bt, algo.kl.estimator), mask_bt, dim=1).mean()
        )
        metrics["kl_reward"] = float(kl_mean)
        metrics["kl_coef"] = float(coef)
        metrics["kl_seq"] = kl_seq
        rewards_b = (token_rewards_bt * mask_bt).sum(dim=1)  # outcome methods need one number per sequence
    if algo.name == "ppo":
        if values_bt is None:
            raise ValueError("ppo needs the critic's values (values_bt)")
        if token_rewards_bt is None:
            token_rewards_bt = A.outcome_to_token_rewards(rewards_b, mask_bt)
        out = ppo_advantages(algo, token_rewards_bt, values_bt, mask_bt)  # type: ignore[arg-type]  # algo.name == ppo: algo is a PpoCfg
        out.metrics = {**metrics, **out.metrics}
        out.kl_seq_mean = kl_seq
        return out
    if algo.name in ("grpo", "dapo", "gspo"):
        adv_b = A.grpo_advantages(rewards_b, n, norm_std=getattr(algo, "norm_std", True))
    elif algo.name == "dr_grpo":
        adv_b = A.grpo_advantages(rewards_b, n, norm_std=False)
    elif algo.name == "rloo":
        adv_b = A.rloo_advantages(rewards_b, n)
    elif algo.name == "reinforce_pp":
        adv_bt = A.reinforce_pp_advantages(
            rewards_b, mask_bt, group_size=n, baseline=getattr(algo, "baseline", False)
        )
        return StepAdvantages(adv_bt, None, metrics, kl_seq_mean=kl_seq)
    else:
        raise NotImplementedError(f"algorithm {algo.name!r} has no advantage estimator here")
    return StepAdvantages(A.expand_to_tokens(adv_b, mask_bt), None, metrics, kl_seq_mean=kl_seq)


def ppo_advantages(
    algo: PpoCfg, token_rewards_bt: Tensor, values_bt: Tensor, mask_bt: Tensor
) -> StepAdvantages:
    """GAE (advantages.gae, gamma / lam from the recipe) over token rewards, then whitened.

    Convention (the same as advantages.gae): `values_bt[:, t]` is V(s_t), the value of the state *before*
    response token t (the critic reads it from the hidden state at the position that predicts token t), and
    `token_rewards_bt[:, t]` the reward after token t (the outcome reward on the last token, minus the KL
    penalty per token with kl.where == reward). After the last token V = 0 (the episode ends).

    The critic's targets are the returns A + V before whitening. The advantages for the policy loss are
    whitened over every valid token of the batch (masked mean and unbiased variance, mean shifted), as
    verl's GAE and OpenRLHF do. Metrics: value_ev, the explained variance 1 - Var[R - V] / Var[R] of the
    returns by these (pre-update) values, in float64 over the valid tokens; value_mean, return_mean.
    """
    mask = mask_bt > 0
    values = torch.where(mask, values_bt.to(token_rewards_bt.dtype), 0.0)
    adv_bt, returns_bt = A.gae(token_rewards_bt, values, mask, gamma=algo.gamma, lam=algo.lam)
    metrics = {
        "value_ev": explained_variance(returns_bt, values, mask),
        "value_mean": float(A.masked_mean(values.double(), mask)),
        "return_mean": float(A.masked_mean(returns_bt.double(), mask)),
    }
    return StepAdvantages(
        A.masked_whiten(adv_bt, mask), token_rewards_bt, metrics, old_values_bt=values, returns_bt=returns_bt
    )


def explained_variance(returns_bt: Tensor, values_bt: Tensor, mask_bt: Tensor) -> float:
    """1 - Var[R - V] / Var[R] over the valid tokens, in float64 (unbiased variances); 0.0 when Var[R] == 0.
    1 is a perfect critic, 0 one no better than the mean return, below 0 worse than that."""
    r, v = returns_bt.double(), values_bt.double()
    var_r = float(A.masked_var(r, mask_bt))
    if var_r <= 0.0:
        return 0.0
    return 1.0 - float(A.masked_var(r - v, mask_bt)) / var_r


def make_value_loss_fn(
    critic: CriticCfg, old_values_bt: Tensor, returns_bt: Tensor, mask_bt: Tensor, *, micro_scale: float = 1.0
) -> ValueLossFn:
    """Critic loss closure over the rows of one mini-batch: `loss_coef * 0.5 * token-mean (V - R)^2`, with the
    PPO value clip around the old values when critic.value_clip is set (losses.value_loss). As make_loss_fn,
    each micro-batch returns its share of the mini-batch's token-mean (times `micro_scale`), so gradient
    accumulation equals one pass over the mini-batch. The critic has its own AdamW, so loss_coef only scales
    its gradient (it matters through gradient clipping and AdamW's eps, as in implementations that sum the
    two losses it would weigh the critic's share)."""
    total = mask_bt.sum().clamp(min=1)

    def loss_fn(values_bt: Tensor, rows: Tensor) -> tuple[Tensor, dict[str, float]]:
        dev = values_bt.device
        mask = mask_bt[rows].to(dev)
        loss, m = L.value_loss(
            values_bt,
            old_values_bt[rows].to(dev),
            returns_bt[rows].to(dev),
            mask,
            clip=critic.value_clip,
            agg="token-mean",
        )
        share = mask.sum().to(values_bt.dtype) / total.to(values_bt.dtype)
        return critic.loss_coef * loss * share * micro_scale, {
            "vf_loss": float(loss.detach()),
            "vf_clip_frac": m["vf_clip_frac"],
        }

    return loss_fn


def _norm_count(mask_bt: Tensor, agg: str) -> Tensor:
    """What the aggregation divides by: valid tokens (token-mean) or valid sequences (seq-mean modes)."""
    if agg == "token-mean":
        return mask_bt.sum()
    return (mask_bt.sum(dim=1) > 0).sum()


@dataclass
class LossInputs:
    """Everything the loss needs besides the live log-probs, for the rows of one mini-batch."""

    adv_bt: Tensor
    mask_bt: Tensor
    old_logp_bt: Tensor | None
    """None: on-policy (one optimizer step per batch): the ratio is exactly 1 and old = logp.detach(). With
    algorithm.rollout_correction.bypass: the rollout's log-probs."""
    ref_logp_bt: Tensor | None
    rollout_logp_bt: Tensor | None
    """The rollout engine's log-probs of the same tokens, for the trainer-vs-rollout agreement metric."""


def make_loss_fn(
    algo: AlgorithmCfg,
    inputs: LossInputs,
    *,
    norm_constant: float,
    micro_scale: float = 1.0,
    record: Callable[[Tensor, Tensor], None] | None = None,
) -> LossFn:
    """Loss closure for TrainEngine.train_step.

    For micro-batch rows `rows`, it returns the micro-batch's share of the mini-batch loss:
    agg(micro) * count(micro) / count(mini). Summed over micro-batches this equals agg(mini) exactly.
    `micro_scale` undoes a 1/num_micro_batches scaling the engine applies (pass num_micro_batches then).

    algorithm.rollout_correction (algo/correction.py): the policy loss is weighted per token by the correction
    factor of the trainer's old log-probs against the rollout's (computed per micro-batch: it is local to a
    token or a sequence), and the mismatch metrics (rc_*) of the micro-batch are returned with the others.
    The trainer's log-probs are the old ones, or the live ones detached when old is None or comes from the
    rollout (bypass). `record(rows, logp)` receives the live log-probs, detached, of every micro-batch.
    """
    total = _norm_count(inputs.mask_bt, algo.loss_agg).clamp(min=1)
    level: L.RatioLevel = "sequence" if algo.name == "gspo" else "token"
    kl_in_loss = algo.kl.where == "loss" and algo.kl.coef > 0
    rc = algo.rollout_correction

    def loss_fn(logp_bt: Tensor, entropy_bt: Tensor, rows: Tensor) -> tuple[Tensor, dict[str, float]]:
        mask = inputs.mask_bt[rows].to(logp_bt.device)
        old = logp_bt.detach() if inputs.old_logp_bt is None else inputs.old_logp_bt[rows].to(logp_bt.device)
        ref = (
            inputs.ref_logp_bt[rows].to(logp_bt.device)
            if kl_in_loss and inputs.ref_logp_bt is not None
            else None
        )
        rollout = None if inputs.rollout_logp_bt is None else inputs.rollout_logp_bt[rows].to(logp_bt.device)
        trainer = logp_bt.detach() if inputs.old_logp_bt is None or rc.bypass else old
        factor = None if rollout is None else C.loss_factor(rc, trainer, rollout, mask)
        loss, metrics = L.total_loss(
            logp_bt, old, inputs.adv_bt[rows].to(logp_bt.device), mask,
            clip_low=algo.clip.low, clip_high=algo.clip.high, dual_clip=algo.clip.dual,
            agg=algo.loss_agg, level=level,
            ref_logp_bt=ref, kl_coef=algo.kl.coef if ref is not None else 0.0, kl_kind=algo.kl.estimator,
            entropy_bt=entropy_bt, entropy_coef=algo.entropy_coef, weight_bt=factor,
        )  # fmt: skip
        if algo.loss_agg == "seq-mean-token-sum-norm":
            loss = loss * (
                mask.shape[1] / norm_constant
            )  # the constant is max_response_tokens, not the padded width
        share = _norm_count(mask, algo.loss_agg).to(logp_bt.dtype) / total.to(logp_bt.dtype)
        if rollout is not None:
            diff = (logp_bt.detach() - rollout).abs()
            valid = mask > 0
            metrics["logprob_diff_mean"] = float(diff[valid].mean()) if valid.any() else 0.0
            metrics["logprob_diff_max"] = float(diff[valid].max()) if valid.any() else 0.0
            metrics.update(C.metrics(rc, trainer, rollout, mask))
        if record is not None:
            record(rows, logp_bt.detach())
        return loss * share * micro_scale, metrics

    return loss_fn
