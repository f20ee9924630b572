"""The adaptive KL controller of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences").

PPO with the KL penalty in the reward (`algorithm.kl.where: reward`) keeps the policy near the reference with
a coefficient beta. A fixed beta is hard to choose; the controller moves it towards a target KL instead:

    e      = clip(KL / target - 1, -0.2, 0.2)
    beta  <- beta * (1 + e * n / horizon)

where KL is this step's mean over sequences of the summed per-token KL estimate (nats per sequence, as in
Ziegler's code and TRL's AdaptiveKLController; verl's controller gets the mean of each sequence's token-mean
KL instead, docs/migrating-from-verl.md), and n the rollouts of the step. The step's rewards use beta
*before* the update (the coefficient reacts to the KL it produced). The state is one float, kept by the
driver and written into every checkpoint so that `rlbridge resume` continues with the same beta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlbridge.recipe.schema import AlgorithmCfg, PpoCfg

MAX_ERROR = 0.2
"""Ziegler et al.'s clip on the proportional error."""


@dataclass
class AdaptiveKlController:
    coef: float
    """The current KL coefficient (beta)."""
    target: float
    horizon: int

    def update(self, kl: float, num_rollouts: int) -> float:
        """Move the coefficient after a step whose mean KL per sequence was `kl`; returns the new value."""
        error = min(max(kl / self.target - 1.0, -MAX_ERROR), MAX_ERROR)
        self.coef *= 1.0 + error * num_rollouts / self.horizon
        return self.coef

    def state(self) -> dict[str, Any]:
        return {"coef": self.coef}

    def load_state(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])


def kl_controller(algo: AlgorithmCfg) -> AdaptiveKlController | None:
    """The controller a recipe asks for (`algorithm.adaptive_kl_target`, PPO only), or None: kl.coef stays fixed."""
    if not isinstance(algo, PpoCfg) or algo.adaptive_kl_target is None:
        return None
    return AdaptiveKlController(
        coef=algo.kl.coef, target=float(algo.adaptive_kl_target), horizon=int(algo.adaptive_kl_horizon)
    )
