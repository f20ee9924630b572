"""Why rollout correction matters, at the objective level: a hand-built bandit trained through rlbridge's own
GRPO advantages (objective.compute_advantages) and loss closure (objective.make_loss_fn), with a rollout
engine whose sampling is systematically off.

The policy is a softmax over 10 tokens (one-token responses, logits trained by SGD). Token 0 earns 1, token 1
earns 0.5 (a trap), the rest 0. The rollout samples from softmax(logits + bias) with bias +3 on the trap token -
a kernel that systematically overrates one token - and reports the log-probs it sampled with, as vLLM does.
The trainer's loss is on-policy (old log-probs = its own), so without correction it takes the rollout's samples
for its own: the trap is over-sampled, pulled up fastest, and the policy settles on it. With token-level
truncated importance weights (pi_trainer / pi_rollout, clamp 2) the gradient is the trainer's own again.

A real-rollout version on the tiny Llama was not used: its random-weight policy has no trap token whose bias
would separate the runs within the < 60 s budget, and reported log-probs that differ from the sampling
distribution (injected noise) are not a mismatch that importance weights can or should correct.

Measured (4 seeds, 40 steps, expected reward of the trainer's policy, mean of the last 5 steps; 3.5 s):
no mismatch 0.988, biased rollout uncorrected 0.474, token TIS (clamp 2) 0.988, IcePop band [0.2, 5] 0.975.
The test asserts the uncorrected run loses at least 0.2 and that each correction recovers at least 80 % of it.
"""

from __future__ import annotations

from typing import Any

import torch

from rlbridge.algo.objective import LossInputs, compute_advantages, make_loss_fn
from rlbridge.recipe.schema import GrpoCfg, RolloutCfg

K, N, PROMPTS, STEPS, LR, BIAS = 10, 8, 16, 40, 1.0, 3.0
SEEDS = (0, 1, 2, 3)


def train(bias: float, correction: dict[str, Any], seed: int) -> list[float]:
    """Expected reward sum_k pi_k r_k of the trainer's policy after each step."""
    reward = torch.zeros(K)
    reward[0], reward[1] = 1.0, 0.5
    kernel = torch.zeros(K)
    kernel[1] = bias
    logits = torch.zeros(K, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=LR)
    algo = GrpoCfg.model_validate({"rollout_correction": correction})
    rollout_cfg = RolloutCfg(n=N)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(PROMPTS * N)
    mask = torch.ones(PROMPTS * N, 1)
    out = []
    for _ in range(STEPS):
        with torch.no_grad():
            rollout_logp = torch.log_softmax(logits + kernel, -1)
        tokens = torch.multinomial(rollout_logp.exp(), PROMPTS * N, replacement=True, generator=gen)
        adv = compute_advantages(algo, rollout_cfg, reward[tokens], mask)
        loss_fn = make_loss_fn(
            algo,
            LossInputs(adv.adv_bt, mask, None, None, rollout_logp[tokens].unsqueeze(1)),
            norm_constant=1.0,
        )
        logp = torch.log_softmax(logits, -1)[tokens].unsqueeze(1)
        loss, _ = loss_fn(logp, torch.zeros_like(logp), rows)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(float((torch.softmax(logits.detach(), -1) * reward).sum()))
    return out


def final(bias: float, correction: dict[str, Any]) -> float:
    runs = [train(bias, correction, s) for s in SEEDS]
    return sum(sum(r[-5:]) / 5 for r in runs) / len(runs)


def test_correction_recovers_the_reward_a_biased_rollout_loses() -> None:
    clean = final(0.0, {})
    biased = final(BIAS, {})
    corrected = final(BIAS, {"weights": "token", "clamp_high": 2.0})
    masked = final(BIAS, {"mask_band": [0.2, 5.0]})
    print(
        f"expected reward: no mismatch {clean:.3f}, biased rollout {biased:.3f}, token TIS {corrected:.3f}, "
        f"IcePop band {masked:.3f}"
    )
    assert clean > 0.95
    assert clean - biased > 0.2, (clean, biased)
    assert (corrected - biased) / (clean - biased) > 0.8, (clean, biased, corrected)
    assert (masked - biased) / (clean - biased) > 0.8, (clean, biased, masked)
    assert final(0.0, {"weights": "token", "clamp_high": 2.0}) == clean  # no mismatch: weights are exactly 1
