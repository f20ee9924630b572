"""The trainer engines a recipe can name, and building the one it names: the one place that maps
`trainer.engine` to its spec (engines/spec.py).

    hf         one trainer process: HFTrainEngine (transformers + peft), HFCritic       engines/hf/spec.py
    megatron   one trainer process per device, each a rank of a torch.distributed group formed before the
               engine is built (trainer/group.py): MegatronTrainEngine, MegatronCritic  engines/megatron/spec.py

Adding an engine: its package (the engine, and a spec module naming its builders, rules and coefficients),
one line in TRAINER_ENGINES, its name among the schema's trainer.engine choices (docs/architecture.md).
Each engine module is imported only when its engine is built, so choosing one imports no engine library.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlbridge.engines.hf.spec import HF
from rlbridge.engines.megatron.spec import MEGATRON
from rlbridge.engines.spec import TrainerEngineSpec

if TYPE_CHECKING:
    from rlbridge.engines.base import Critic, TrainEngine
    from rlbridge.recipe.schema import Recipe

TRAINER_ENGINES: dict[str, TrainerEngineSpec] = {e.name: e for e in (HF, MEGATRON)}
"""trainer.engine -> its spec."""


def trainer_engine(recipe: Recipe) -> TrainerEngineSpec:
    """The spec of the recipe's trainer.engine."""
    return TRAINER_ENGINES[recipe.trainer.engine]


def trainer_engines_that(has: Callable[[TrainerEngineSpec], bool]) -> str:
    """The names of the engines with a property, for messages ("hf", "hf or megatron")."""
    return " or ".join(name for name, e in TRAINER_ENGINES.items() if has(e))


def device(recipe: Recipe) -> str:
    """Where this process's engine runs: cuda when the recipe asks for it and this process sees a GPU."""
    import torch

    return "cuda" if recipe.cluster.device == "cuda" and torch.cuda.is_available() else "cpu"


def build_engine(recipe: Recipe, model_dir: Path) -> TrainEngine:
    return trainer_engine(recipe).build(recipe, model_dir, device(recipe))


def build_critic(recipe: Recipe, model_dir: Path) -> Critic | None:
    """PPO's critic next to the policy engine; None for the critic-free algorithms."""
    if not recipe.algorithm.has_critic:
        return None
    return trainer_engine(recipe).build_critic(recipe, model_dir, device(recipe))
