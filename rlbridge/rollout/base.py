"""The rollout protocol (vllm and hf engines), driven by loop.py.

Weights carry a version number: `load_weights` sets it, `generate` refuses to run when the caller
expects a newer version than the engine holds (stale weights sample the wrong policy silently otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlbridge.batch import Rollouts
from rlbridge.engines.base import WeightExport


@dataclass(frozen=True)
class SamplingCfg:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    greedy: bool = False
    """Greedy decoding (evaluation): temperature 0, n must be 1."""


class StaleWeightsError(RuntimeError):
    """generate() was asked for a weight version the engine does not hold."""


class RolloutEngine(Protocol):
    weight_version: int

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingCfg, *, expect_version: int) -> Rollouts:
        """n completions per prompt, grouped: rows [i*n, (i+1)*n) belong to prompt i."""
        ...

    def load_weights(self, weights: WeightExport, version: int) -> None:
        """Make the engine sample from these weights from now on."""
        ...

    def shutdown(self) -> None: ...
