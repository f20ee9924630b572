"""The rollout protocol (vllm and hf engines), driven by loop.py.

Weights carry a version number: `load_weights` sets it, `generate` refuses to run when the caller
expects a newer version than the engine holds (stale weights sample the wrong policy silently otherwise).

Sampling is reproducible per call: `generate(..., seed=s)` re-seeds the engine's sampling RNG with `s`
first, so the same prompts, weights and seed give the same tokens whatever ran before (the loop passes one
seed per step, which is what makes a resumed run sample what the uninterrupted one did). Without a seed the
engine's RNG simply continues.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlbridge.batch import Rollouts
from rlbridge.weights import WeightExport


@dataclass(frozen=True)
class SamplingCfg:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    greedy: bool = False
    """Greedy decoding (evaluation): temperature 0, n must be 1."""
    ignore_eos: bool = False
    """Sample past EOS to max_tokens (rollout.ignore_eos)."""


class StaleWeightsError(RuntimeError):
    """generate() was asked for a weight version the engine does not hold."""


class RolloutEngine(Protocol):
    weight_version: int

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingCfg,
        *,
        expect_version: int,
        seed: int | None = None,
        group_seeds: list[int] | None = None,
    ) -> Rollouts:
        """n completions per prompt, grouped: rows [i*n, (i+1)*n) belong to prompt i. `seed`: re-seed the
        sampling RNG first (same seed, prompts and weights -> same tokens); None continues the RNG.
        group_seeds: one seed per prompt, each prompt's completions sampled from their own generator, whatever
        else the call holds (engines whose spec has seeds_per_group; the others refuse it)."""
        ...

    def load_weights(self, weights: WeightExport, version: int) -> None:
        """Make the engine sample from these weights from now on."""
        ...

    def shutdown(self) -> None: ...


class SleepingRolloutEngine(RolloutEngine, Protocol):
    """A rollout engine that reserves device memory up front and lends it to the trainer on shared GPUs
    (its spec's reserves_memory: vLLM)."""

    def sleep(self, level: int = 1) -> None:
        """Free the device memory (weights offloaded, KV cache freed)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what sleep() freed (tags: 'weights', 'kv_cache'; None: all)."""
        ...
