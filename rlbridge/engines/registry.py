"""Which trainer engine and which critic a recipe gets: the one place that reads `trainer.engine` to build one.

    hf         one trainer process: HFTrainEngine (transformers + peft), HFCritic
    megatron   one trainer process per device, each a rank of a torch.distributed group formed before the
               engine is built (trainer/group.py): MegatronTrainEngine, MegatronCritic

Each engine module is imported only when its engine is built, so choosing one imports no engine library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlbridge.engines.base import Critic, TrainEngine
from rlbridge.recipe.schema import Recipe


@dataclass(frozen=True)
class EngineKind:
    name: str
    multi_rank: bool
    """One trainer process per device, ranks of a torch.distributed group (else one trainer process)."""
    build: Callable[[Recipe, Path, str], TrainEngine]
    """(recipe, model directory, device) -> the engine; a multi-rank engine joins the group formed already."""
    build_critic: Callable[[Recipe, Path, str], Critic]
    """The same for PPO's critic, built after the engine (on every rank of a multi-rank trainer)."""


def _hf_engine(recipe: Recipe, model_dir: Path, device: str) -> TrainEngine:
    from rlbridge.engines.hf import HFTrainEngine

    return HFTrainEngine(recipe, model_dir, device=device)


def _hf_critic(recipe: Recipe, model_dir: Path, device: str) -> Critic:
    from rlbridge.engines.hf_critic import HFCritic

    return HFCritic(recipe, model_dir, device=device)


def _megatron_engine(recipe: Recipe, model_dir: Path, device: str) -> TrainEngine:
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(recipe)


def _megatron_critic(recipe: Recipe, model_dir: Path, device: str) -> Critic:
    from rlbridge.engines.megatron.critic import MegatronCritic

    return MegatronCritic(recipe)


ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind("hf", multi_rank=False, build=_hf_engine, build_critic=_hf_critic),
    "megatron": EngineKind(
        "megatron", multi_rank=True, build=_megatron_engine, build_critic=_megatron_critic
    ),
}


def engine_kind(recipe: Recipe) -> EngineKind:
    return ENGINES[recipe.trainer.engine]


def device(recipe: Recipe) -> str:
    """Where this process's engine runs: cuda when the recipe asks for it and this process sees a GPU."""
    return "cuda" if recipe.cluster.device == "cuda" and torch.cuda.is_available() else "cpu"


def build_engine(recipe: Recipe, model_dir: Path) -> TrainEngine:
    return engine_kind(recipe).build(recipe, model_dir, device(recipe))


def build_critic(recipe: Recipe, model_dir: Path) -> Critic | None:
    """PPO's critic next to the policy engine; None for the critic-free algorithms."""
    if not recipe.algorithm.has_critic:
        return None
    return engine_kind(recipe).build_critic(recipe, model_dir, device(recipe))
