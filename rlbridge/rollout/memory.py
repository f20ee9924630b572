"""Colocated GPUs: when vLLM holds memory and when it lets go, as an explicit state machine.

Trainer and rollout share the devices. During the update vLLM sleeps (weights offloaded, KV cache freed);
afterwards the order matters (users hit out-of-memory otherwise, see vllm#15254 / NeMo-RL#191):

    AWAKE --sleep()--> ASLEEP --wake weights--> WEIGHTS_ONLY --load new weights--> (same)
          --wake kv_cache--> AWAKE

so the old weights and the KV cache are never resident next to the freshly exported weights. Every
transition is checked: calling them out of order raises instead of silently doubling memory. On CPU, or
when not colocated, the machine is `enabled=False` and all transitions are no-ops that keep the state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlbridge.rollout.client import RolloutClient


class RolloutState(Enum):
    AWAKE = "awake"
    ASLEEP = "asleep"
    WEIGHTS_ONLY = "weights_only"


class RolloutMemory:
    def __init__(self, rollout: RolloutClient, *, enabled: bool) -> None:
        """rollout: the client whose engine sleeps and wakes (rollout/client.py)."""
        self.rollout = rollout
        self.enabled = enabled
        self.state = RolloutState.AWAKE
        self.seconds: dict[str, float] = {}
        """Seconds spent in vLLM's sleep (`sleep_s`) and wake-ups (`wake_s`) since take_seconds()."""

    def _move(self, expected: RolloutState, new: RolloutState, key: str, act: Callable[[], None]) -> None:
        """`act` (sleep or a wake-up) moves the engine from `expected` to `new`; its seconds count as `key`."""
        if self.state is not expected:
            raise RuntimeError(
                f"rollout memory: to {new.value} from state {self.state.value}, expected {expected.value}"
            )
        if self.enabled:
            start = time.perf_counter()
            act()
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
        self.state = new

    def take_seconds(self) -> dict[str, float]:
        """The step's sleep_s / wake_s (none when disabled), and start counting again."""
        out, self.seconds = self.seconds, {}
        return out

    def release(self) -> None:
        """Before the update: offload weights, free the KV cache."""
        self._move(RolloutState.AWAKE, RolloutState.ASLEEP, "sleep_s", lambda: self.rollout.sleep(1))

    def load(self, load_weights: Callable[[], Any]) -> Any:
        """Weight sync: wake the weights only, load the new ones, then re-allocate the KV cache."""
        if self.state is RolloutState.AWAKE and not self.enabled:
            return load_weights()
        if self.state is RolloutState.AWAKE:  # e.g. the first sync after a resume: no update ran yet
            self.release()
        self._move(
            RolloutState.ASLEEP,
            RolloutState.WEIGHTS_ONLY,
            "wake_s",
            lambda: self.rollout.wake_up(["weights"]),
        )
        out = load_weights()
        self._move(
            RolloutState.WEIGHTS_ONLY,
            RolloutState.AWAKE,
            "wake_s",
            lambda: self.rollout.wake_up(["kv_cache"]),
        )
        return out
