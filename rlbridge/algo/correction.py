"""The rollout-vs-trainer mismatch: measured every step, and corrected when the recipe asks.

The rollout engine samples with its own kernels (vLLM, bf16), so the probability it gave a sampled token,
pi_rollout, is never exactly the trainer's pi_trainer for the same weights; off-policy data widens the gap.
The policy gradient assumes samples from pi_trainer. With `algorithm.rollout_correction`
(recipe/schema/algorithm.py, docs/rollout-correction.md) the per-token policy loss is multiplied by a
detached factor built here:

    log w_t = logp_trainer_t - logp_rollout_t          (clamped to [-20, 20], as the PPO log-ratio)
    weights: token     u_t = w_t
             sequence  u_t = exp(mean_t' log w_t')     (the geometric mean, on every token of the sequence)
    factor_t = min(u_t, clamp_high) * keep_t           (1 * keep_t with weights: none)

where keep_t is 0 for tokens outside `mask_band` (judged per token or per sequence) or rejected by a
divergence above `reject.threshold`. A masked token keeps its place in the loss's denominator (it is a
zero importance weight, not a shorter batch), which is what lets every micro-batch compute its own factors
with the mini-batch's normalization unchanged. The factor multiplies the PPO-clipped per-token surrogate
(decoupled PPO: the clip controls the step against the trainer's old policy, the weight corrects for who
sampled), for every policy loss in losses.py; KL and entropy terms and PPO's critic are not weighted.

Everything is computed in float64 from detached inputs. The module has no recipe logic beyond reading its
section, so every function is tested against hand-written float64 loops (tests/unit/algo/test_correction.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from rlbridge.recipe.schema import HealthCfg, RejectCfg, RolloutCorrectionCfg

LOG_W_CLAMP = 20.0
F64 = torch.float64

__all__ = ["divergence", "health_problems", "log_weights", "loss_factor", "metrics", "sequence_log_weights"]


def log_weights(trainer_logp_bt: Tensor, rollout_logp_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """[b, t] float64 log w = trainer - rollout log-prob, clamped to [-20, 20]; 0 on padding (any value there)."""
    valid = mask_bt > 0
    d = trainer_logp_bt.detach().to(F64) - rollout_logp_bt.detach().to(F64)
    return torch.where(valid, d, 0.0).clamp(-LOG_W_CLAMP, LOG_W_CLAMP)


def sequence_log_weights(log_w_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """[b] mean log w over each sequence's valid tokens (log of the geometric-mean weight); 0 for an empty row."""
    valid = (mask_bt > 0).to(F64)
    return (log_w_bt * valid).sum(1) / valid.sum(1).clamp(min=1.0)


def divergence(log_w_bt: Tensor, kind: str) -> Tensor:
    """Per-token divergence between rollout and trainer from log w: k1 = |log w|, k2 = (log w)^2 / 2,
    k3 = w - 1 - log w (computed as expm1(log w) - log w; >= 0)."""
    if kind == "k1":
        return log_w_bt.abs()
    if kind == "k2":
        return 0.5 * log_w_bt * log_w_bt
    if kind == "k3":
        return (torch.expm1(log_w_bt) - log_w_bt).clamp(min=0.0)
    raise ValueError(f"unknown divergence {kind!r}; expected k1, k2 or k3")


def _unit_log_weights(log_w_bt: Tensor, mask_bt: Tensor, level: str) -> Tensor:
    """[b, t] log weight of the unit each token belongs to: its own (token) or its sequence's mean (sequence)."""
    if level == "token":
        return log_w_bt
    return sequence_log_weights(log_w_bt, mask_bt).unsqueeze(1).expand_as(log_w_bt)


def _rejected(cfg: RejectCfg, log_w_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """[b, t] bool: tokens the divergence rule leaves out (on valid tokens only)."""
    valid = mask_bt > 0
    div = torch.where(valid, divergence(log_w_bt, cfg.divergence), 0.0)
    if cfg.level == "token":
        out = div > cfg.threshold
    elif cfg.level == "sequence_mean":
        out = ((div.sum(1) / valid.sum(1).clamp(min=1)) > cfg.threshold).unsqueeze(1).expand_as(div)
    elif cfg.level == "sequence_max":
        out = (div.amax(1) > cfg.threshold).unsqueeze(1).expand_as(div)
    else:
        raise ValueError(f"unknown rejection level {cfg.level!r}")
    return out & valid


def keep_mask(cfg: RolloutCorrectionCfg, log_w_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """[b, t] bool: valid tokens that neither mask_band nor reject leaves out."""
    valid = mask_bt > 0
    keep = valid.clone()
    if cfg.mask_band is not None:
        low, high = cfg.mask_band
        unit = _unit_log_weights(log_w_bt, mask_bt, cfg.mask_level)
        keep &= (unit >= math.log(low) if low > 0 else torch.ones_like(keep)) & (unit <= math.log(high))
    if cfg.reject is not None:
        keep &= ~_rejected(cfg.reject, log_w_bt, mask_bt)
    return keep


def loss_factor(
    cfg: RolloutCorrectionCfg, trainer_logp_bt: Tensor, rollout_logp_bt: Tensor, mask_bt: Tensor
) -> Tensor | None:
    """[b, t] detached factor for the per-token policy loss (see the module docstring), in the trainer's dtype;
    0 on padding. None when the section changes nothing (weights none, no band, no rejection): the loss is then
    exactly today's."""
    if not cfg.active:
        return None
    log_w = log_weights(trainer_logp_bt, rollout_logp_bt, mask_bt)
    keep = keep_mask(cfg, log_w, mask_bt)
    factor = torch.ones_like(log_w)
    if cfg.weights != "none":
        factor = torch.exp(_unit_log_weights(log_w, mask_bt, cfg.weights))
        if cfg.clamp_high is not None:
            factor = factor.clamp(max=cfg.clamp_high)
    return torch.where(keep, factor, 0.0).to(trainer_logp_bt.dtype)


def metrics(
    cfg: RolloutCorrectionCfg, trainer_logp_bt: Tensor, rollout_logp_bt: Tensor, mask_bt: Tensor
) -> dict[str, float]:
    """The mismatch in numbers (float64, over the valid tokens; every value 0.0 on a batch without any):

    rc_weight_mean / _std / _min / _max   raw importance weights (before truncation and masks) of the units of
                                          `weights` (tokens with weights none); std is the population std
    rc_ess                                normalized effective sample size (sum u)^2 / (n sum u^2), in (0, 1]
    rc_clip_high_frac                     units whose weight clamp_high truncates (0 with weights none)
    rc_mask_low_frac / rc_mask_high_frac  units of mask_level below / above mask_band (0 without a band)
    rc_masked_token_frac                  valid tokens left out of the policy loss (band or rejection)
    rc_masked_seq_frac                    sequences with every valid token left out
    rc_trainer_log_ppl / rc_rollout_log_ppl  mean over sequences of -mean_t logp (log-perplexity)
    rc_log_ppl_diff                       trainer minus rollout log-perplexity (= -mean over sequences of log w_seq)
    rc_kl_k3                              token mean of w - 1 - log w: the k3 estimate of KL(rollout || trainer)
    rc_chi2                               token mean of w^2 - 1: chi-square divergence of trainer from rollout (a
                                          sample estimate: can be slightly negative)
    """
    valid = mask_bt > 0
    seqs = valid.any(1)
    if not bool(valid.any()):
        return dict.fromkeys(METRIC_KEYS, 0.0)
    log_w = log_weights(trainer_logp_bt, rollout_logp_bt, mask_bt)
    level = "token" if cfg.weights == "none" else cfg.weights
    if level == "token":
        u = torch.exp(log_w[valid])
    else:
        u = torch.exp(sequence_log_weights(log_w, mask_bt)[seqs])
    n = u.numel()
    mean = float(u.mean())
    out = {
        "rc_weight_mean": mean,
        "rc_weight_std": float(((u - mean) ** 2).mean().sqrt()),
        "rc_weight_min": float(u.min()),
        "rc_weight_max": float(u.max()),
        "rc_ess": float(u.sum() ** 2 / (n * (u * u).sum())),
        "rc_clip_high_frac": float((u > cfg.clamp_high).to(F64).mean())
        if cfg.weights != "none" and cfg.clamp_high is not None
        else 0.0,
    }
    low_frac = high_frac = 0.0
    if cfg.mask_band is not None:
        band_u = log_w[valid] if cfg.mask_level == "token" else sequence_log_weights(log_w, mask_bt)[seqs]
        low, high = cfg.mask_band
        low_frac = float((band_u < math.log(low)).to(F64).mean()) if low > 0 else 0.0
        high_frac = float((band_u > math.log(high)).to(F64).mean())
    keep = keep_mask(cfg, log_w, mask_bt)
    dropped = valid & ~keep
    seq_n = valid.sum(1).clamp(min=1).to(F64)
    trainer = torch.where(valid, trainer_logp_bt.detach().to(F64), 0.0)
    rollout = torch.where(valid, rollout_logp_bt.detach().to(F64), 0.0)
    trainer_ppl = float((-(trainer.sum(1) / seq_n))[seqs].mean())
    rollout_ppl = float((-(rollout.sum(1) / seq_n))[seqs].mean())
    lw = log_w[valid]
    out.update(
        rc_mask_low_frac=low_frac,
        rc_mask_high_frac=high_frac,
        rc_masked_token_frac=float(dropped.sum()) / float(valid.sum()),
        rc_masked_seq_frac=float((seqs & ~keep.any(1)).sum()) / float(seqs.sum()),
        rc_trainer_log_ppl=trainer_ppl,
        rc_rollout_log_ppl=rollout_ppl,
        rc_log_ppl_diff=trainer_ppl - rollout_ppl,
        rc_kl_k3=float(divergence(lw, "k3").mean()),
        rc_chi2=float(torch.exp(2.0 * lw).mean() - 1.0),
    )
    return out


METRIC_KEYS = (
    "rc_weight_mean",
    "rc_weight_std",
    "rc_weight_min",
    "rc_weight_max",
    "rc_ess",
    "rc_clip_high_frac",
    "rc_mask_low_frac",
    "rc_mask_high_frac",
    "rc_masked_token_frac",
    "rc_masked_seq_frac",
    "rc_trainer_log_ppl",
    "rc_rollout_log_ppl",
    "rc_log_ppl_diff",
    "rc_kl_k3",
    "rc_chi2",
)


def health_problems(health: HealthCfg, m: Mapping[str, object]) -> list[str]:
    """What is wrong with one step's mismatch metrics by run.health's limits (an empty list when nothing is, or
    when the step has no such metrics)."""
    out: list[str] = []
    mean, ess = m.get("rc_weight_mean"), m.get("rc_ess")
    low, high = health.is_weight_range
    if isinstance(mean, (int, float)) and not low <= mean <= high:
        out.append(f"mean importance weight {mean:.3g} is outside run.health.is_weight_range [{low}, {high}]")
    if isinstance(ess, (int, float)) and ess < health.min_ess:
        out.append(
            f"effective sample size {ess:.3g} of the importance weights is under run.health.min_ess {health.min_ess}"
        )
    return out


class MismatchNotices:
    """When to speak of run.health's importance-weight limits, so that a gap that persists is not repeated on
    every step: the full text at the first step outside the limits, a one-line reminder every `every` steps while
    they stay out, and a line when the weights are back within them."""

    def __init__(
        self, every: int = 10, *, back: str = "the importance weights are back within run.health's limits"
    ) -> None:
        self.every = every
        self.back = back
        """What the line at the end of a gap says (before "(outside since step N)")."""
        self.since: int | None = None  # the first step of the current run of steps outside the limits

    def notice(self, step: int, problems: list[str]) -> str | None:
        """The text to print at this step (None: nothing)."""
        if not problems:
            if self.since is None:
                return None
            since, self.since = self.since, None
            return f"step {step}: {self.back} (outside since step {since})"
        if self.since is None:
            self.since = step
            return f"step {step}: rollout and trainer disagree: {'; '.join(problems)}"
        if (step - self.since) % self.every == 0:
            return f"step {step}: rollout and trainer still disagree (since step {self.since}): {'; '.join(problems)}"
        return None
