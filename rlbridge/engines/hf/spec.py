"""The hf trainer engine as the rest of rlbridge sees it (engines/spec.py): transformers + peft in one process
(engines/hf/engine.py, engines/hf/critic.py), the embedded default on a machine without GPUs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlbridge.engines.spec import TrainerEngineSpec, TrainerMemory

if TYPE_CHECKING:
    from rlbridge.engines.base import Critic, TrainEngine
    from rlbridge.export import Exported
    from rlbridge.recipe.schema import Recipe
    from rlbridge.run.resume import ResumePoint
    from rlbridge.weights import WeightSync


def _engine(recipe: Recipe, model_dir: Path, device: str) -> TrainEngine:
    from rlbridge.engines.hf.engine import HFTrainEngine

    return HFTrainEngine(recipe, model_dir, device=device)


def _critic(recipe: Recipe, model_dir: Path, device: str) -> Critic:
    from rlbridge.engines.hf.critic import HFCritic

    return HFCritic(recipe, model_dir, device=device)


def _export(recipe: Recipe, point: ResumePoint, kind: WeightSync, log: Callable[[str], None]) -> Exported:
    """Its checkpoints hold the peft model's own trainable tensors: loaded back into the same peft model."""
    from rlbridge.export import hf_exporter

    return hf_exporter(recipe, point, kind, log)


HF = TrainerEngineSpec(
    name="hf",
    build=_engine,
    build_critic=_critic,
    exporter=_export,
    memory=TrainerMemory(mlp_bytes=8.0, logits_bytes=8.0, lora_input_copies=True, logits_response_only=True),
    moe="peft",
    shared_prompts=True,
    cuda_graphs=True,
    packed_passes=True,
    exports_dora=True,
    auto_width_multiple_cuda=16,  # recipe/schema.AUTO_WIDTH_MULTIPLE (a test keeps them equal)
)
