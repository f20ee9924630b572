"""The rollout engines a recipe can name: the one place that maps `rollout.engine` to its spec
(rollout/spec.py).

    vllm   vLLM (CUDA or CPU build) in one worker        rollout/vllm_spec.py
    hf     transformers.generate in one worker           rollout/hf_spec.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rlbridge.rollout.hf_spec import HF_ROLLOUT
from rlbridge.rollout.spec import RolloutEngineSpec
from rlbridge.rollout.vllm_spec import VLLM

if TYPE_CHECKING:
    from rlbridge.recipe.schema import Recipe

ROLLOUT_ENGINES: dict[str, RolloutEngineSpec] = {e.name: e for e in (VLLM, HF_ROLLOUT)}
"""rollout.engine -> its spec."""


def rollout_engine(recipe: Recipe) -> RolloutEngineSpec:
    """The spec of the recipe's rollout.engine."""
    return ROLLOUT_ENGINES[recipe.rollout.engine]


def rollout_engines_that(has: Callable[[RolloutEngineSpec], bool]) -> str:
    """The names of the engines with a property, for messages."""
    return " or ".join(name for name, e in ROLLOUT_ENGINES.items() if has(e))
