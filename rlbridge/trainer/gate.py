"""The first-update health gate (run.health.first_step): the first updates with a learning signal must really
train. A finite, positive gradient norm; no frozen tensor moved; every trainable tensor changed (LoRA's B starts
at zero, so its A gets no gradient on the first such update: two are allowed); on an MoE model every expert the
router sent tokens to trained. A failure stops the run with a HealthError that says which tensors and how to turn
the gate off. TrainerRole (role.py) asks it before and after each update; a checkpoint keeps whether it passed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlbridge.engines.base import ExpertEngine, MoeBook, TrainEngine
from rlbridge.engines.moe import ExpertId, expert_report, sum_counts
from rlbridge.errors import RlbridgeError


class HealthError(RlbridgeError):
    """A health gate failed; the message says which and how to turn it off."""


class FirstStepGate:
    """The gate of one trainer process's engine, from its first update until it passes."""

    def __init__(self, engine: TrainEngine, *, enabled: bool) -> None:
        self.engine = engine
        self.done = not enabled
        """The gate passed (or run.health.first_step is off): nothing more to check."""
        self.signal_updates = 0
        """Updates with a learning signal since the gate started."""
        self.start: dict[str, torch.Tensor] | None = None
        """The trainable tensors before the gate's first update."""
        self.frozen: dict[str, float] | None = None
        """The frozen tensors' fingerprint before the gate's first update."""
        self.routed: dict[ExpertId, int] = {}
        """Tokens routed per expert in the training forwards since the gate started (MoE models)."""

    def begin(self) -> None:
        """Before an update: the starting point, taken once until the gate passes (collective on a multi-rank
        engine with experts: every rank starts the gate together)."""
        if self.start is not None or self.done:
            return
        self.start = {k: v.detach().clone() for k, v in self.engine.trainable_state().items()}
        self.frozen = self.engine.frozen_fingerprint()
        moe = self._moe()
        if moe is not None:
            moe.routed_tokens()
            self.routed = {}

    def restore(self, *, done: bool, signal_updates: int) -> None:
        """A checkpoint's gate state: the starting point is taken again at the next update."""
        self.done, self.signal_updates = done, signal_updates
        self.start = self.frozen = None

    def check(self, m: dict[str, Any], *, has_signal: bool) -> None:
        """After an update with metrics `m`: a HealthError when it did not train (see the class); the gate passes
        (and stops checking) once every trainable tensor has changed."""
        if self.done or self.start is None or not has_signal or m.get("skipped"):
            return
        self.signal_updates += 1
        gn = m.get("grad_norm", float("nan"))
        if not math.isfinite(gn) or gn <= 0:
            raise HealthError(
                f"first update: grad_norm is {gn} (expected finite and > 0): nothing is training. "
                "Check LoRA targets and recompute settings; turn the gate off with run.health.first_step: false"
            )
        now = self.engine.trainable_state()
        frozen = self.engine.frozen_fingerprint()
        moved_frozen = [k for k, v in frozen.items() if self.frozen is not None and v != self.frozen.get(k)]
        if moved_frozen:
            raise HealthError(
                f"frozen tensors changed during the update: {', '.join(moved_frozen[:5])}"
                f"{' ...' if len(moved_frozen) > 5 else ''} (run.health.first_step: false turns this check off)"
            )
        unchanged = [k for k, v in now.items() if torch.equal(v, self.start[k])]
        unchanged = self._check_experts(now, unchanged)
        # LoRA's B starts at zero, so A gets no gradient on the first update with a signal: allow two.
        if unchanged and self.signal_updates >= 2:
            raise HealthError(
                f"{len(unchanged)} of {len(now)} trainable tensors did not change after {self.signal_updates} "
                "updates with a learning signal: "
                f"{', '.join(unchanged[:5])}{' ...' if len(unchanged) > 5 else ''} "
                "(run.health.first_step: false turns this check off)"
            )
        if not unchanged:
            self.done = True
            self.start = None

    def _moe(self) -> MoeBook | None:
        return self.engine.moe if isinstance(self.engine, ExpertEngine) else None

    def _check_experts(self, now: dict[str, torch.Tensor], unchanged: list[str]) -> list[str]:
        """On an MoE model: every expert the router sent tokens to must have trained (each of its adapter tensors,
        or parts of packed ones, changed); a dead one stops the run by name. Tensors of experts that received no
        tokens cannot change and are left out of `unchanged` (returned)."""
        moe = self._moe()
        if moe is None or self.start is None:
            return unchanged
        self.routed = sum_counts([self.routed, moe.routed_tokens()])
        report = expert_report(moe.expert_views(self.start), moe.expert_views(now), self.routed)
        if report.dead and self.signal_updates >= 2:
            raise HealthError(
                f"{len(report.dead)} experts received tokens but their adapters did not change after "
                f"{self.signal_updates} updates with a learning signal: {report.describe(report.dead)} "
                "(expert LoRA detached from autograd?). run.health.first_step: false turns this check off"
            )
        idle = set(report.unrouted)

        def only_idle(name: str) -> bool:
            keys = set(moe.expert_views({name: now[name]}))
            return bool(keys) and keys <= idle

        return [k for k in unchanged if not only_idle(k)]
