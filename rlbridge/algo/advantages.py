"""Advantage estimators for RL post-training of LLMs, as plain torch functions.

What this module simplifies, compared with the reference implementations (verl, TRL, OpenRLHF):

* Groups are *contiguous*: a batch of ``b = num_groups * group_size`` rollouts holds the samples of
  prompt 0 first, then prompt 1, ...  No uid / index dictionaries; a ``view(num_groups, group_size)``.
  Every group function requires ``group_size >= 2`` (a group of one has no within-group signal) and
  ``b % group_size == 0``; both raise ``ValueError`` otherwise.
* Outcome rewards are one scalar per sequence (``rewards_b``).  Token-level rewards (``rewards_bt``) are
  only used by GAE and the KL-in-reward shaping in ``losses.kl_in_reward``.
* Masks are 0/1 (bool, int or float) with ``mask_bt[i, t] == 1`` on response tokens.  Padding may hold
  any value, even NaN or inf: every function selects with ``torch.where`` (never ``x * mask``), and
  every ``[b, t]`` output is exactly 0 at masked positions.
* Masked statistics divide by ``max(count, 1)`` instead of ``count + 1e-8``: exact when ``count >= 1``
  and 0 (not NaN) on an empty mask.
* Functions are dtype-preserving: float64 in gives float64 out (the tests check against float64 loops).

Shape suffixes in names: ``_b`` batch, ``_t`` response tokens, ``_g`` groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "as_bool_mask",
    "dynamic_sampling_filter",
    "expand_to_tokens",
    "gae",
    "grpo_advantages",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_to_token_rewards",
    "overlong_penalty",
    "reinforce_pp_advantages",
    "rloo_advantages",
]


# --------------------------------------------------------------------------------------------------
# masked helpers
# --------------------------------------------------------------------------------------------------


def as_bool_mask(mask: Tensor) -> Tensor:
    """A 0/1 mask (bool, int or float) as bool."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set (over everything, or along ``dim``); padding values are ignored."""
    kept = torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def _count(mask: Tensor, dim: int | None, dtype: torch.dtype) -> Tensor:
    m = as_bool_mask(mask).to(dtype)
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the masked entries: ``sum / max(count, 1)``, so an empty mask gives 0."""
    return masked_sum(x, mask, dim) / _count(mask, dim, x.dtype).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, dim: int | None = None, *, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over the masked entries.

    ``unbiased=True`` (default, as verl's ``masked_var``) divides by ``count - 1``.  The divisor is clamped
    at 1, so one valid entry (or none) gives 0 instead of NaN.
    """
    mean = masked_mean(x, mask, dim)
    centered = x - (mean if dim is None else mean.unsqueeze(dim))
    sq = masked_sum(centered * centered, mask, dim)
    count = _count(mask, dim, x.dtype)
    return sq / (count - 1 if unbiased else count).clamp(min=1)


def masked_whiten(x_bt: Tensor, mask_bt: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and (unbiased) variance over all valid entries.

    As verl's ``masked_whiten``; with ``shift_mean=False`` the mean is added back (scale only).
    Masked positions are set to 0.
    """
    mean = masked_mean(x_bt, mask_bt)
    var = masked_var(x_bt, mask_bt)
    whitened = (x_bt - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(as_bool_mask(mask_bt), whitened, torch.zeros_like(whitened))


def expand_to_tokens(adv_b: Tensor, mask_bt: Tensor) -> Tensor:
    """Broadcast one value per sequence over its valid tokens: ``[b] -> [b, t]``, 0 on padding."""
    if adv_b.dim() != 1 or mask_bt.dim() != 2 or adv_b.shape[0] != mask_bt.shape[0]:
        raise ValueError(
            f"expected adv_b [b] and mask_bt [b, t], got {tuple(adv_b.shape)}, {tuple(mask_bt.shape)}"
        )
    full = adv_b.unsqueeze(1).expand(mask_bt.shape)
    return torch.where(as_bool_mask(mask_bt), full, torch.zeros_like(full))


def outcome_to_token_rewards(rewards_b: Tensor, mask_bt: Tensor) -> Tensor:
    """Place each sequence's outcome reward on its last valid token: ``[b] -> [b, t]``.

    A sequence without valid tokens gets an all-zero row (its reward has nowhere to go).
    """
    if rewards_b.dim() != 1 or mask_bt.dim() != 2 or rewards_b.shape[0] != mask_bt.shape[0]:
        raise ValueError(f"expected [b] and [b, t], got {tuple(rewards_b.shape)}, {tuple(mask_bt.shape)}")
    mask = as_bool_mask(mask_bt)
    t = mask.shape[1]
    last_t = t - 1 - mask.flip(1).to(torch.int8).argmax(dim=1)  # index of the last True per row
    out = torch.zeros(mask.shape, dtype=rewards_b.dtype, device=rewards_b.device)
    has_tokens = mask.any(dim=1)
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    out[rows, last_t[has_tokens]] = rewards_b[has_tokens]
    return out


# --------------------------------------------------------------------------------------------------
# outcome (critic-free) estimators
# --------------------------------------------------------------------------------------------------


def _groups(rewards_b: Tensor, group_size: int) -> Tensor:
    """``[b] -> [g, group_size]`` after checking the layout."""
    if rewards_b.dim() != 1:
        raise ValueError(f"rewards_b must be 1-D [b], got shape {tuple(rewards_b.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size}")
    if rewards_b.shape[0] % group_size != 0:
        raise ValueError(f"batch size {rewards_b.shape[0]} is not a multiple of group_size {group_size}")
    return rewards_b.view(-1, group_size)


def _all_equal_g(rewards_gn: Tensor) -> Tensor:
    """True for groups whose rewards are exactly equal (max == min; robust where a float std is not)."""
    return rewards_gn.amax(dim=1) == rewards_gn.amin(dim=1)


def grpo_advantages(
    rewards_b: Tensor, group_size: int, *, norm_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO outcome advantage: ``(r - mean_group) / (std_group + eps)``, one value per sequence ``[b]``.

    * ``std`` is the *unbiased* (Bessel, ``n - 1``) group standard deviation, as ``torch.std`` in verl and
      TRL; ``eps`` is added to the std (not the variance), as both do (verl's eps is this default, 1e-6;
      TRL's GRPOTrainer uses 1e-4).
    * ``norm_std=False`` is Dr. GRPO (mean-centred only).
    * Groups whose rewards are all equal get exactly 0 (not a ``1e-17 / eps`` rounding residue).
    """
    r_gn = _groups(rewards_b, group_size)
    adv_gn = r_gn - r_gn.mean(dim=1, keepdim=True)
    if norm_std:
        adv_gn = adv_gn / (r_gn.std(dim=1, unbiased=True, keepdim=True) + eps)
    adv_gn = torch.where(_all_equal_g(r_gn).unsqueeze(1), torch.zeros_like(adv_gn), adv_gn)
    return adv_gn.reshape(-1)


def rloo_advantages(rewards_b: Tensor, group_size: int) -> Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j`` within each group (leave-one-out baseline), ``[b]``.

    Computed as ``r_i - (sum - r_i) / (n - 1)``.  Needs ``group_size >= 2``.
    """
    r_gn = _groups(rewards_b, group_size)
    loo_baseline = (r_gn.sum(dim=1, keepdim=True) - r_gn) / (group_size - 1)
    return (r_gn - loo_baseline).reshape(-1)


def reinforce_pp_advantages(
    rewards_b: Tensor,
    mask_bt: Tensor,
    *,
    group_size: int | None = None,
    baseline: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ advantages ``[b, t]`` (0 on padding).

    The outcome reward sits on the last valid token; with ``gamma = 1`` (fixed here) the token return is
    the same reward on every valid token.  ``baseline=True`` (REINFORCE++-baseline) first subtracts the
    group mean reward (needs ``group_size``).  The token returns are then whitened over *all valid tokens
    of the batch* (masked mean and unbiased masked variance, ``eps`` added to the variance), so longer
    sequences weigh more, as in verl.
    """
    if baseline:
        if group_size is None:
            raise ValueError("reinforce++ baseline needs group_size")
        r_gn = _groups(rewards_b, group_size)
        rewards_b = (r_gn - r_gn.mean(dim=1, keepdim=True)).reshape(-1)
    returns_bt = expand_to_tokens(rewards_b, mask_bt)
    return masked_whiten(returns_bt, mask_bt, eps=eps)


# --------------------------------------------------------------------------------------------------
# critic-based estimator
# --------------------------------------------------------------------------------------------------


def gae(
    rewards_bt: Tensor, values_bt: Tensor, mask_bt: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation; returns ``(advantages_bt, returns_bt)``, both 0 on padding.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where "t+1"
    is the next *valid* token: masked positions are skipped (their reward and value are ignored), so
    right padding bootstraps with ``V = 0`` after the last valid token and interior holes (e.g. tool
    observations) are passed through, as verl does.  ``returns = A + V``.  No whitening here: call
    ``masked_whiten(advantages_bt, mask_bt)`` if wanted.
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    if not rewards_bt.shape == values_bt.shape == mask_bt.shape or rewards_bt.dim() != 2:
        raise ValueError("rewards_bt, values_bt and mask_bt must share one [b, t] shape")
    mask = as_bool_mask(mask_bt)
    zero = torch.zeros((), dtype=values_bt.dtype, device=values_bt.device)
    rewards = torch.where(mask, rewards_bt, zero)
    values = torch.where(mask, values_bt, zero)
    next_value = torch.zeros_like(values[:, 0])
    last_adv = torch.zeros_like(values[:, 0])
    adv_reversed: list[Tensor] = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        last_adv = torch.where(mask[:, t], adv_t, last_adv)
        adv_reversed.append(torch.where(mask[:, t], adv_t, zero))
    advantages_bt = torch.stack(adv_reversed[::-1], dim=1)
    returns_bt = torch.where(mask, advantages_bt + values, zero)
    return advantages_bt, returns_bt


# --------------------------------------------------------------------------------------------------
# DAPO tricks
# --------------------------------------------------------------------------------------------------


def dynamic_sampling_filter(rewards_b: Tensor, group_size: int) -> tuple[Tensor, int]:
    """DAPO dynamic sampling: keep the groups whose rewards are not all equal.

    Returns ``(keep_mask_g, num_dropped)``: a bool ``[num_groups]`` mask and how many groups it drops.
    "All equal" is exact ``max == min`` (verl tests ``np.std > 0``, which a float mean of identical
    values like 0.1 can make a tiny positive number).  Expand to samples with
    ``keep_mask_g.repeat_interleave(group_size)``.
    """
    keep_g = ~_all_equal_g(_groups(rewards_b, group_size))
    return keep_g, int((~keep_g).sum().item())


def overlong_penalty(lengths_b: Tensor, *, max_len: int, buffer: int, penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, to add to the outcome reward, ``[b]``.

    0 for ``len <= max_len - buffer``; linear from 0 down to ``-penalty_factor`` over the buffer zone;
    ``-penalty_factor`` at and beyond ``max_len`` (clamped; verl keeps decreasing past ``max_len``, but a
    generation cannot be longer than ``max_len`` there).  Needs ``0 < buffer <= max_len``.
    Integer lengths give a tensor of the default float dtype.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    lengths = lengths_b if lengths_b.is_floating_point() else lengths_b.to(torch.get_default_dtype())
    exceed_frac = ((lengths - (max_len - buffer)) / buffer).clamp(min=0.0, max=1.0)
    return -penalty_factor * exceed_frac
