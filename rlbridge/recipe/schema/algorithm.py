"""The recipe's `algorithm` section: a discriminated union on `algorithm.name`, so each algorithm accepts only
its own keys; the KL, clipping and rollout-correction sub-sections every algorithm shares."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlbridge.recipe.schema.base import PositiveInt, Section


class KlCfg(Section):
    coef: Annotated[float, Field(ge=0)] = 0.0
    """KL coefficient against the reference policy (the model with adapters off, or the initial weights)."""
    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator: k1 = log ratio, k2 = half squared log ratio, k3 = low_var_kl (clamped, non-negative)."""
    where: Literal["loss", "reward"] = "loss"
    """Add the KL term to the loss, or subtract it from the token rewards."""


class ClipCfg(Section):
    low: Annotated[float, Field(ge=0, lt=1)] = 0.2
    """Ratio clipped below at 1 - low."""
    high: Annotated[float, Field(ge=0)] = 0.2
    """Ratio clipped above at 1 + high (DAPO's clip-higher sets it above low)."""
    dual: Annotated[float, Field(gt=1)] | None = None
    """Dual clip constant c > 1 bounding the loss for negative advantages; null turns it off."""


class RejectCfg(Section):
    divergence: Literal["k1", "k2", "k3"] = "k3"
    """Per-token divergence between rollout and trainer, with log w = trainer - rollout log-prob: k1 = |log w|,
    k2 = 0.5 (log w)^2, k3 = w - 1 - log w (each >= 0; 0 when both agree)."""
    level: Literal["token", "sequence_mean", "sequence_max"] = "token"
    """What is rejected: each token whose divergence exceeds the threshold, or each whole sequence whose mean
    (sequence_mean) or largest (sequence_max) token divergence does."""
    threshold: Annotated[float, Field(gt=0)]
    """Rejection threshold (nats for k1; e.g. 0.5 for k1, 0.1 for k2 / k3)."""


class RolloutCorrectionCfg(Section):
    """Correction for the gap between the rollout engine's and the trainer's log-probs (docs/rollout-correction.md).
    The defaults change nothing: no weights, no masks, old log-probs from the trainer."""

    weights: Literal["none", "token", "sequence"] = "none"
    """Importance weights w = pi_trainer / pi_rollout of the sampled tokens, detached, multiplied into the per-token
    policy loss: none, per token, or per sequence (the geometric mean exp(mean_t log w_t), on every token)."""
    clamp_high: Annotated[float, Field(gt=1)] | None = 2.0
    """Truncated importance sampling: weights above this are set to it; null keeps them untruncated. Only used with
    weights token or sequence."""
    mask_band: tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(gt=0)]] | None = None
    """[low, high] with low < 1 < high (IcePop-style): tokens (or sequences, see mask_level) whose importance ratio
    lies outside are left out of the policy loss; null masks nothing."""
    mask_level: Literal["token", "sequence"] = "token"
    """Unit that mask_band judges: each token's ratio, or each sequence's geometric-mean ratio (the whole sequence
    is masked)."""
    reject: RejectCfg | None = None
    """Leave out tokens or sequences whose divergence between rollout and trainer exceeds a threshold; null: none."""
    bypass: bool = False
    """Take the old log-probs from the rollout instead of a trainer forward: the PPO ratio is then against the
    rollout policy (which corrects the mismatch inside the clip) and a step with several optimizer updates
    (data.mini_batch_size < batch_size or trainer.ppo_epochs > 1) runs one forward fewer. Excludes weights,
    mask_band and reject."""

    @property
    def active(self) -> bool:
        """Whether the policy loss changes (weights, masks or rejection): bypass changes the old log-probs instead."""
        return self.weights != "none" or self.mask_band is not None or self.reject is not None


LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class _AlgoBase(Section):
    kl: KlCfg = KlCfg()
    clip: ClipCfg = ClipCfg()
    rollout_correction: RolloutCorrectionCfg = RolloutCorrectionCfg()
    entropy_coef: Annotated[float, Field(ge=0)] = 0.0
    """Entropy bonus coefficient: above 0 it rewards keeping the policy's entropy up (against early collapse of
    exploration); it also computes the entropy's gradient. At 0 the entropy is a metric only: neither engine
    differentiates it (its vocabulary-wide product has no backward)."""
    loss_agg: LossAgg = "token-mean"
    """How token losses are aggregated into one number."""

    @property
    def trains_entropy(self) -> bool:
        """The entropy bonus is in the loss (entropy_coef above 0); else the engines compute the entropy as a
        metric, without autograd."""
        return self.entropy_coef != 0

    @property
    def has_critic(self) -> bool:
        """Whether the algorithm trains a value model (PPO's critic) next to the policy."""
        return False


class GrpoCfg(_AlgoBase):
    name: Literal["grpo"] = "grpo"
    norm_std: bool = True
    """Divide group-centred rewards by the group standard deviation."""


class DrGrpoCfg(_AlgoBase):
    name: Literal["dr_grpo"]
    loss_agg: LossAgg = "seq-mean-token-sum-norm"


class OverlongCfg(Section):
    buffer: Annotated[int, Field(ge=0)] = 0
    """Soft overlong penalty zone (tokens before max_response_tokens); 0 turns the penalty off."""
    penalty: Annotated[float, Field(ge=0)] = 1.0
    """Penalty at max_response_tokens; grows linearly through the buffer."""


class DapoCfg(_AlgoBase):
    name: Literal["dapo"]
    clip: ClipCfg = ClipCfg(low=0.2, high=0.28)
    loss_agg: LossAgg = "token-mean"
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and refill the batch."""
    max_refill_rounds: PositiveInt = 3
    """Extra generation rounds allowed per step to refill dropped groups."""
    overlong: OverlongCfg = OverlongCfg()


class GspoCfg(_AlgoBase):
    name: Literal["gspo"]
    clip: ClipCfg = ClipCfg(low=3.0e-4, high=4.0e-4)
    loss_agg: LossAgg = "seq-mean-token-mean"


class RlooCfg(_AlgoBase):
    name: Literal["rloo"]


class ReinforcePPCfg(_AlgoBase):
    name: Literal["reinforce_pp"]
    baseline: bool = False
    """Subtract the group mean before batch normalization (REINFORCE++-baseline)."""


class CriticCfg(Section):
    lr: Annotated[float, Field(gt=0)] = 1.0e-5
    """Critic learning rate."""
    value_clip: Annotated[float, Field(gt=0)] | None = 0.2
    """Value-loss clipping around the old values; null turns it off."""
    loss_coef: Annotated[float, Field(gt=0)] = 0.5
    """Weight of the value loss."""


class PpoCfg(_AlgoBase):
    name: Literal["ppo"]
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Discount factor for GAE."""
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    """GAE lambda."""
    critic: CriticCfg = CriticCfg()
    adaptive_kl_target: Annotated[float, Field(gt=0)] | None = None
    """Target KL per sequence (nats, summed over the response tokens) of the adaptive KL controller (Ziegler et
    al. 2019): after each step kl.coef is multiplied by 1 + clip(kl / target - 1, -0.2, 0.2) * rollouts /
    adaptive_kl_horizon, starting from kl.coef. Needs kl.where: reward and kl.coef > 0; null keeps kl.coef fixed."""
    adaptive_kl_horizon: PositiveInt = 10000
    """Horizon of the adaptive KL controller in rollouts (Ziegler et al. 2019 and TRL use 10000): the larger, the
    slower kl.coef moves (at most x1.2 per horizon rollouts)."""

    @property
    def has_critic(self) -> bool:
        return True


AlgorithmCfg = Annotated[
    GrpoCfg | DrGrpoCfg | DapoCfg | GspoCfg | RlooCfg | ReinforcePPCfg | PpoCfg,
    Field(discriminator="name"),
]
GROUP_ALGORITHMS = frozenset({"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"})
