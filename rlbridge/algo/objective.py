"""The recipe's `algorithm` section turned into numbers: advantages per sequence/token and the loss closure.

The pure functions in advantages.py / losses.py know nothing of recipes; this module picks and wires
them per `algorithm.name`, and makes micro-batching exact: a loss aggregated over a whole mini-batch
(token-mean, seq-mean, ...) is split into per-micro-batch pieces whose sum equals the full-batch value,
so gradient accumulation gives the same update as one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlbridge.algo import advantages as A
from rlbridge.algo import losses as L
from rlbridge.recipe.schema import AlgorithmCfg, RolloutCfg


@dataclass
class StepAdvantages:
    adv_bt: Tensor
    """[b, R] advantages per response token (0 on padding)."""
    token_rewards_bt: Tensor | None
    """Token rewards after the KL penalty (only with kl.where == reward)."""
    metrics: dict[str, float]


def compute_advantages(
    algo: AlgorithmCfg,
    rollout: RolloutCfg,
    rewards_b: Tensor,
    mask_bt: Tensor,
    *,
    logp_bt: Tensor | None = None,
    ref_logp_bt: Tensor | None = None,
) -> StepAdvantages:
    """Advantages for the GRPO family (PPO's critic path lives with the critic)."""
    n = rollout.n
    metrics: dict[str, float] = {}
    rewards_b = rewards_b.to(torch.float32)
    if algo.kl.where == "reward" and algo.kl.coef > 0:
        if logp_bt is None or ref_logp_bt is None:
            raise ValueError("kl.where == reward needs policy and reference log-probs")
        token_rewards_bt, kl_mean = L.kl_in_reward(rewards_b, logp_bt, ref_logp_bt, mask_bt, algo.kl.coef, algo.kl.estimator)
        metrics["kl_reward"] = float(kl_mean)
        rewards_b = (token_rewards_bt * mask_bt).sum(dim=1)  # outcome methods need one number per sequence
    if algo.name in ("grpo", "dapo", "gspo"):
        adv_b = A.grpo_advantages(rewards_b, n, norm_std=getattr(algo, "norm_std", True))
    elif algo.name == "dr_grpo":
        adv_b = A.grpo_advantages(rewards_b, n, norm_std=False)
    elif algo.name == "rloo":
        adv_b = A.rloo_advantages(rewards_b, n)
    elif algo.name == "reinforce_pp":
        adv_bt = A.reinforce_pp_advantages(rewards_b, mask_bt, group_size=n, baseline=getattr(algo, "baseline", False))
        return StepAdvantages(adv_bt, None, metrics)
    else:
        raise NotImplementedError(f"algorithm {algo.name!r} needs a critic (not in this loop yet)")
    return StepAdvantages(A.expand_to_tokens(adv_b, mask_bt), None, metrics)


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
    """None: on-policy (one optimizer step per batch): the ratio is exactly 1 and old = logp.detach()."""
    ref_logp_bt: Tensor | None
    rollout_logp_bt: Tensor | None
    """The rollout engine's log-probs of the same tokens, for the trainer-vs-rollout agreement metric."""


def make_loss_fn(algo: AlgorithmCfg, inputs: LossInputs, *, norm_constant: float, micro_scale: float = 1.0):  # type: ignore[no-untyped-def]
    """Loss closure for TrainEngine.train_step.

    For micro-batch rows `rows`, it returns the micro-batch's share of the mini-batch loss:
    agg(micro) * count(micro) / count(mini). Summed over micro-batches this equals agg(mini) exactly.
    `micro_scale` undoes a 1/num_micro_batches scaling the engine applies (pass num_micro_batches then).
    """
    total = _norm_count(inputs.mask_bt, algo.loss_agg).clamp(min=1)
    level: L.RatioLevel = "sequence" if algo.name == "gspo" else "token"
    kl_in_loss = algo.kl.where == "loss" and algo.kl.coef > 0

    def loss_fn(logp_bt: Tensor, entropy_bt: Tensor, rows: Tensor) -> tuple[Tensor, dict[str, float]]:
        mask = inputs.mask_bt[rows].to(logp_bt.device)
        old = logp_bt.detach() if inputs.old_logp_bt is None else inputs.old_logp_bt[rows].to(logp_bt.device)
        ref = inputs.ref_logp_bt[rows].to(logp_bt.device) if kl_in_loss and inputs.ref_logp_bt is not None else None
        loss, metrics = L.total_loss(
            logp_bt, old, inputs.adv_bt[rows].to(logp_bt.device), mask,
            clip_low=algo.clip.low, clip_high=algo.clip.high, dual_clip=algo.clip.dual,
            agg=algo.loss_agg, level=level,
            ref_logp_bt=ref, kl_coef=algo.kl.coef if ref is not None else 0.0, kl_kind=algo.kl.estimator,
            entropy_bt=entropy_bt, entropy_coef=algo.entropy_coef,
        )  # fmt: skip
        if algo.loss_agg == "seq-mean-token-sum-norm":
            loss = loss * (mask.shape[1] / norm_constant)  # the constant is max_response_tokens, not the padded width
        share = _norm_count(mask, algo.loss_agg).to(logp_bt.dtype) / total.to(logp_bt.dtype)
        if inputs.rollout_logp_bt is not None:
            diff = (logp_bt.detach() - inputs.rollout_logp_bt[rows].to(logp_bt.device)).abs()
            valid = mask > 0
            metrics["logprob_diff_mean"] = float(diff[valid].mean()) if valid.any() else 0.0
            metrics["logprob_diff_max"] = float(diff[valid].max()) if valid.any() else 0.0
        return loss * share * micro_scale, metrics

    return loss_fn
