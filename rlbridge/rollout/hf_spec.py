"""The hf rollout engine as the rest of rlbridge sees it (rollout/spec.py); the engine is rollout/hf.py
(transformers.generate)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlbridge.rollout.spec import RolloutEngineSpec

if TYPE_CHECKING:
    from rlbridge.recipe.schema import Recipe
    from rlbridge.rollout.base import RolloutEngine


def _worker() -> type[RolloutEngine]:
    from rlbridge.rollout.hf import HFRollout

    return HFRollout


def _kwargs(r: Recipe, threads: int) -> dict[str, Any]:
    """On a CPU in async mode it computes beside the trainer: its own share of the cores."""
    cpu_async = r.cluster.device == "cpu" and r.rollout.mode == "async"
    return {"seed": r.run.seed, **({"num_threads": threads} if cpu_async else {})}


HF_ROLLOUT = RolloutEngineSpec(name="hf", worker=_worker, worker_kwargs=_kwargs, stand_in=True)
