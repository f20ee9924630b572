"""Policy, value, entropy and KL losses for RL post-training of LLMs, as plain torch functions.

Conventions (see also ``rlbridge.algo.advantages``):

* Everything per token is ``[b, t]`` over the *response* tokens, with a 0/1 ``mask_bt``.  Padding may
  hold any value (even NaN / inf): inputs are sanitised with ``torch.where`` before any ``exp``, so
  neither the loss nor its gradient sees them, and padded tokens get a zero gradient.
* Losses are returned as 0-d tensors (to ``backward``); metrics as a ``dict[str, float]``.  Every metric
  is 0.0 on a batch without valid tokens.
* Token log-ratios are clamped to ``[-20, 20]`` before ``exp`` (as verl does); a token whose log-ratio is
  beyond that gets no gradient from the ratio.  GSPO (``level="sequence"``) clamps only the detached
  sequence mean to ``[-20, 20]`` and keeps each token's gradient; verl instead clamps the per-token
  log-ratio at +10 (see ``policy_loss``).

Differences from verl's ``core_algos.py`` are listed, each checked numerically, in
docs/migrating-from-verl.md ("Loss and advantage formulas"): ``seq-mean-token-sum-norm`` and GSPO's clamp
differ; the other aggregations, the PPO clip, the KL estimators, entropy and value losses agree.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rlbridge.algo.advantages import (
    as_bool_mask,
    masked_mean,
    masked_sum,
    masked_var,
    outcome_to_token_rewards,
)

__all__ = [
    "AggMode",
    "KLKind",
    "RatioLevel",
    "aggregate",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_estimate",
    "kl_in_reward",
    "policy_loss",
    "total_loss",
    "value_loss",
]

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RatioLevel = Literal["token", "sequence"]

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _zero_pad(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _item(x: Tensor) -> float:
    return float(x.detach().item())


# --------------------------------------------------------------------------------------------------
# KL and aggregation
# --------------------------------------------------------------------------------------------------


def kl_estimate(logp_bt: Tensor, ref_logp_bt: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3), elementwise.

    With ``d = logp - ref_logp``:

    * ``k1``: ``d``.  Unbiased, high variance, can be negative.
    * ``k2``: ``0.5 * d**2``.  Biased, low variance, >= 0; its gradient is that of the true KL.
    * ``k3`` / ``low_var_kl``: ``exp(-d) + d - 1`` i.e. ``ratio - log(ratio) - 1`` with
      ``ratio = pi_ref / pi``.  Unbiased, low variance, >= 0.  As verl: the log-ratio is clamped to
      ``[-20, 20]`` before ``exp`` and the result to ``[., 10]``.  Computed as ``expm1(x) - x`` (no
      cancellation for small ``x``) and clamped below at 0, which only removes rounding noise.
    """
    d = logp_bt - ref_logp_bt
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        x = (-d).clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        return (torch.expm1(x) - x).clamp(min=0.0, max=K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of k1, k2, k3, low_var_kl")


def aggregate(
    loss_bt: Tensor, mask_bt: Tensor, mode: AggMode, *, norm_constant: float | None = None
) -> Tensor:
    """Reduce a per-token loss ``[b, t]`` to a scalar.

    * ``token-mean``: sum over all valid tokens / number of valid tokens.
    * ``seq-mean-token-sum``: per-sequence sum, then mean over sequences.
    * ``seq-mean-token-mean``: per-sequence mean, then mean over sequences.
    * ``seq-mean-token-sum-norm`` (Dr. GRPO): per-sequence sum / ``norm_constant``, then mean over
      sequences, i.e. ``total_sum / (num_seqs * norm_constant)``; ``norm_constant`` defaults to the
      padded response length ``mask_bt.shape[1]``.  Only this mode accepts ``norm_constant``.  This is
      the Dr. GRPO paper's and TRL's ``dr_grpo``; verl's ``agg_loss`` of the same name returns
      ``total_sum / norm_constant``, larger by the number of sequences.

    "Sequences" are those with at least one valid token: fully masked rows (dummy / filtered samples)
    count in no denominator, as in current verl.  An empty batch gives 0, never NaN.
    """
    if norm_constant is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"norm_constant only applies to seq-mean-token-sum-norm, not {mode!r}")
    mask = as_bool_mask(mask_bt)
    if mode == "token-mean":
        return masked_mean(loss_bt, mask)
    seq_mask_b = mask.any(dim=1)
    seq_sum_b = masked_sum(loss_bt, mask, dim=1)
    if mode == "seq-mean-token-sum":
        return masked_mean(seq_sum_b, seq_mask_b)
    if mode == "seq-mean-token-mean":
        return masked_mean(masked_mean(loss_bt, mask, dim=1), seq_mask_b)
    if mode == "seq-mean-token-sum-norm":
        norm = float(mask.shape[1]) if norm_constant is None else float(norm_constant)
        if norm <= 0:
            raise ValueError(f"norm_constant must be > 0, got {norm}")
        return masked_mean(seq_sum_b, seq_mask_b) / norm
    raise ValueError(f"unknown aggregation mode {mode!r}")


# --------------------------------------------------------------------------------------------------
# policy loss
# --------------------------------------------------------------------------------------------------


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: RatioLevel) -> Tensor:
    """Per-token log importance ratio (token level, or GSPO's straight-through sequence level)."""
    token_lr = logp - old_logp
    if level == "token":
        return token_lr.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    if level == "sequence":
        seq_lr_b = masked_mean(token_lr.detach(), mask, dim=1)
        seq_lr_b = seq_lr_b.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        # value: log s_i on every token; gradient: d logp_t (GSPO's token-level form of s_i).
        return seq_lr_b.unsqueeze(1) + logp - logp.detach()
    raise ValueError(f"unknown ratio level {level!r}; expected 'token' or 'sequence'")


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")


def policy_loss(
    logp_bt: Tensor,
    old_logp_bt: Tensor,
    adv_bt: Tensor,
    mask_bt: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    agg: AggMode = "token-mean",
    level: RatioLevel = "token",
    weight_bt: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, with asymmetric clip (DAPO clip-higher), dual clip and GSPO.

        Per token, with ``ratio = exp(logp - old_logp)`` and ``A = adv``:
        ``l = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``; with ``dual_clip = c > 1``,
        tokens with ``A < 0`` get ``min(l, -A * c)`` (the loss of a very off-policy token is capped).
        ``level="sequence"`` is GSPO: the ratio is ``s_i = exp(mean_t(logp - old_logp))`` over the valid
        tokens of sequence i, used per token in the straight-through form ``sg[s_i] * exp(logp_t -
        sg[logp_t])`` so gradients flow per token (the GSPO paper's objective is ``agg="seq-mean-token-mean"``).
        The clamp to ``[-20, 20]`` applies to the detached ``log s_i`` only, so every token keeps its
        gradient. verl clamps ``log s_i + logp_t - sg[logp_t]`` at +10 instead: above a mean log-ratio of 10
        its ratio stays ``exp(10)`` with no gradient (it matters for a negative advantage, where the
        unclipped term is chosen); verl's GSPO also ignores the dual clip, which is applied here when set.
    ``weight_bt`` (detached, e.g. the rollout correction's importance weights, ``rlbridge.algo.correction``)
    multiplies the per-token loss after both clips, before aggregation; the metrics do not see it.

        Metrics (over valid tokens): ``clip_frac`` (the clipped term is chosen, i.e. the clip zeroes the
        gradient), ``dual_clip_frac`` (the dual-clip cap is active), ``approx_kl`` (mean of the k2 estimate
        ``0.5 * (logp - old_logp)**2`` at token level, >= 0), ``ratio_min`` / ``ratio_max`` / ``ratio_mean``
        of the ratio used in the loss.
    """
    _check_clip(clip_low, clip_high, dual_clip)
    mask = as_bool_mask(mask_bt)
    logp, old_logp, adv = _zero_pad(logp_bt, mask), _zero_pad(old_logp_bt, mask), _zero_pad(adv_bt, mask)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, level))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(min=1.0 - clip_low, max=1.0 + clip_high)
    loss_bt = torch.maximum(loss_unclipped, loss_clipped)
    dual_active = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (loss_bt > cap)
        loss_bt = torch.where(dual_active, cap, loss_bt)
    if weight_bt is not None:
        loss_bt = loss_bt * _zero_pad(weight_bt.detach(), mask)
    loss = aggregate(loss_bt, mask, agg)
    with torch.no_grad():
        ratio_valid = ratio[mask]
        has_tokens = ratio_valid.numel() > 0
        metrics = {
            "clip_frac": _item(masked_mean((loss_clipped > loss_unclipped).to(ratio.dtype), mask)),
            "dual_clip_frac": _item(masked_mean(dual_active.to(ratio.dtype), mask)),
            "approx_kl": _item(masked_mean(kl_estimate(logp, old_logp, "k2"), mask)),
            "ratio_min": _item(ratio_valid.min()) if has_tokens else 0.0,
            "ratio_max": _item(ratio_valid.max()) if has_tokens else 0.0,
            "ratio_mean": _item(masked_mean(ratio, mask)),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# entropy, value, KL-in-reward
# --------------------------------------------------------------------------------------------------


def entropy_from_logits(logits_btv: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``[..., v] -> [...]``.

    Stable: ``-sum(p * log_softmax)``, with ``log_softmax`` floored at the dtype's finite minimum so
    ``-inf`` logits (masked vocabulary) add 0 instead of NaN, also in the gradient.  ``chunk_size``
    processes that many rows (flattened leading dims) at a time, bounding the ``[rows, v]`` temporaries
    (mostly useful under ``torch.no_grad``).
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead_shape = logits_btv.shape[:-1]
    flat = logits_btv.reshape(-1, logits_btv.shape[-1])
    step = flat.shape[0] if chunk_size is None else chunk_size
    parts: list[Tensor] = []
    for start in range(0, flat.shape[0], max(step, 1)):
        logp = torch.log_softmax(flat[start : start + step], dim=-1)
        logp = logp.clamp(min=torch.finfo(logp.dtype).min)
        parts.append(-(logp.exp() * logp).sum(dim=-1))
    if not parts:
        return flat.new_zeros(lead_shape)
    return torch.cat(parts).reshape(lead_shape)


def entropy_bonus(entropy_bt: Tensor, mask_bt: Tensor, coef: float, agg: AggMode = "token-mean") -> Tensor:
    """Loss term rewarding entropy: ``-coef * aggregate(entropy_bt, mask_bt, agg)`` (add it to the loss)."""
    return -coef * aggregate(entropy_bt, mask_bt, agg)


def _explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over valid tokens; 0.0 when ``Var[R] == 0`` or there are < 2 tokens."""
    var_returns = masked_var(returns, mask)
    if _item(var_returns) <= 0.0:
        return 0.0
    return _item(1.0 - masked_var(returns - values, mask) / var_returns)


def value_loss(
    values_bt: Tensor,
    old_values_bt: Tensor,
    returns_bt: Tensor,
    mask_bt: Tensor,
    *,
    clip: float | None = None,
    agg: AggMode = "token-mean",
) -> tuple[Tensor, dict[str, float]]:
    """Critic loss ``0.5 * (V - R)**2``, or with ``clip = c`` the PPO value clip
    ``0.5 * max((V - R)**2, (clip(V, V_old - c, V_old + c) - R)**2)``, aggregated with ``agg``.

    Metrics: ``vf_clip_frac`` (valid tokens where the clipped term is larger, 0 without clip) and
    ``explained_variance`` of the returns by the *current* values (``1 - Var[R - V] / Var[R]``, masked).
    """
    if clip is not None and clip < 0:
        raise ValueError(f"value clip must be >= 0, got {clip}")
    mask = as_bool_mask(mask_bt)
    values, returns = _zero_pad(values_bt, mask), _zero_pad(returns_bt, mask)
    loss_bt = (values - returns) ** 2
    clip_active = torch.zeros_like(mask)
    if clip is not None:
        old = _zero_pad(old_values_bt, mask)
        loss_clipped = (torch.clamp(values, min=old - clip, max=old + clip) - returns) ** 2
        clip_active = loss_clipped > loss_bt
        loss_bt = torch.maximum(loss_bt, loss_clipped)
    loss = 0.5 * aggregate(loss_bt, mask, agg)
    with torch.no_grad():
        metrics = {
            "vf_clip_frac": _item(masked_mean(clip_active.to(values.dtype), mask)),
            "explained_variance": _explained_variance(values, returns, mask),
        }
    return loss, metrics


def kl_in_reward(
    rewards: Tensor, logp_bt: Tensor, ref_logp_bt: Tensor, mask_bt: Tensor, coef: float, kind: KLKind = "k1"
) -> tuple[Tensor, float]:
    """KL penalty in the reward (``algorithm.kl.where: reward``): ``r_t - coef * kl_t`` on valid tokens.

    ``rewards`` is either token rewards ``[b, t]`` or outcome rewards ``[b]`` (placed on the last valid
    token first).  Returns ``(token_rewards_bt, mean_kl)``: 0 on padding, and the token-mean of the
    KL estimate over valid tokens (before ``coef``).  Nothing here carries gradient.
    """
    mask = as_bool_mask(mask_bt)
    with torch.no_grad():
        token_rewards = outcome_to_token_rewards(rewards, mask) if rewards.dim() == 1 else rewards
        if token_rewards.shape != mask.shape:
            raise ValueError(
                f"rewards must be [b] or [b, t] = {tuple(mask.shape)}, got {tuple(rewards.shape)}"
            )
        kl_bt = _zero_pad(kl_estimate(_zero_pad(logp_bt, mask), _zero_pad(ref_logp_bt, mask), kind), mask)
        new_rewards = _zero_pad(token_rewards - coef * kl_bt, mask)
        return new_rewards, _item(masked_mean(kl_bt, mask))


def total_loss(
    logp_bt: Tensor,
    old_logp_bt: Tensor,
    adv_bt: Tensor,
    mask_bt: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    agg: AggMode = "token-mean",
    level: RatioLevel = "token",
    ref_logp_bt: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "low_var_kl",
    entropy_bt: Tensor | None = None,
    entropy_coef: float = 0.0,
    weight_bt: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Actor loss: ``policy_loss + kl_coef * agg(kl(logp, ref)) - entropy_coef * agg(entropy)``.

    The KL term (``algorithm.kl.where: loss``) needs ``ref_logp_bt`` when ``kl_coef != 0``; the entropy
    bonus needs ``entropy_bt`` when ``entropy_coef != 0``.  Metrics: those of ``policy_loss`` plus
    ``pg_loss``, ``kl_loss`` (aggregated KL before the coefficient; only with ``ref_logp_bt``),
    ``entropy`` (aggregated entropy; only with ``entropy_bt``) and ``loss``.  ``weight_bt`` weighs the
    policy term only (see ``policy_loss``).
    """
    if kl_coef != 0.0 and ref_logp_bt is None:
        raise ValueError("kl_coef != 0 needs ref_logp_bt")
    if entropy_coef != 0.0 and entropy_bt is None:
        raise ValueError("entropy_coef != 0 needs entropy_bt")
    mask = as_bool_mask(mask_bt)
    pg, metrics = policy_loss(
        logp_bt, old_logp_bt, adv_bt, mask, clip_low=clip_low, clip_high=clip_high,
        dual_clip=dual_clip, agg=agg, level=level, weight_bt=weight_bt,
    )  # fmt: skip
    loss = pg
    metrics["pg_loss"] = _item(pg)
    if ref_logp_bt is not None:
        kl_bt = kl_estimate(_zero_pad(logp_bt, mask), _zero_pad(ref_logp_bt, mask), kl_kind)
        kl = aggregate(kl_bt, mask, agg)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = _item(kl)
    if entropy_bt is not None:
        metrics["entropy"] = _item(aggregate(entropy_bt.detach(), mask, agg))
    # at entropy_coef 0 the entropy is a metric: no backward through it (its vocabulary-wide product)
    if entropy_bt is not None and entropy_coef != 0.0:
        loss = loss + entropy_bonus(_zero_pad(entropy_bt, mask), mask, entropy_coef, agg)
    metrics["loss"] = _item(loss)
    return loss, metrics
