"""What a trainer engine is, said once: `TrainerEngineSpec`, one per engine (engines/hf/spec.py,
engines/megatron/spec.py), listed in engines/registry.py.

Everything that differs between engines outside the engine's own code is a field here: how the engine and its
critic are built, what the recipe may ask of it (the checks read these fields), its memory coefficients (the
plan reads them), how `export-hf` turns its checkpoints into a Hugging Face directory. Recipe checks, the plan,
export, the smoke run and the session ask the spec; none of them compares `trainer.engine` to a name.

This module imports nothing heavy (recipe validation and `rlbridge plan` read it): the builders and the
exporter import their engine when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rlbridge.engines.base import Critic, TrainEngine
    from rlbridge.export import Exporter
    from rlbridge.recipe.schema import Recipe

ParallelDim = Literal["tensor", "pipeline", "context", "expert", "expert_tensor"]
"""The model-parallel sizes of trainer.parallel."""
PARALLEL_DIMS: tuple[ParallelDim, ...] = ("tensor", "pipeline", "context", "expert", "expert_tensor")

MoeImpl = Literal["peft", "megatron-core"]
"""How an engine trains a mixture-of-experts model, which decides the MoE rules of recipe/checks/model.py:
peft: LoRA on the stacked expert weights (target_parameters: no dropout, no DoRA, gate and up together);
megatron-core: expert parallelism, sequence parallelism under tensor parallelism, routing replayed per
micro-batch through megatron-core's RouterReplay."""


@dataclass(frozen=True)
class TrainerMemory:
    """The engine's terms in plan.activation_gib (see its docstring for the formula)."""

    mlp_bytes: float
    """Bytes per token and MLP width unit the layer keeps for the backward (16-bit model)."""
    logits_bytes: float
    """Bytes per scored position and vocabulary entry (logits, their gradient, softmax temporaries)."""
    lora_input_copies: bool
    """peft casts each adapted module's input to float32 under a 16-bit model (an extra copy per module)."""
    logits_response_only: bool
    """The logits are computed for the response positions only, whatever the layout (else only at context
    parallel 1 without sequence parallel under tensor parallel)."""


@dataclass(frozen=True)
class TrainerEngineSpec:
    """One trainer engine. The capabilities default to none: what a spec does not claim, the recipe checks
    refuse."""

    name: str
    """The recipe's trainer.engine."""
    build: Callable[[Recipe, Path, str], TrainEngine]
    """(recipe, model directory, device) -> the engine; a multi-rank engine joins the group formed already."""
    build_critic: Callable[[Recipe, Path, str], Critic]
    """The same for PPO's critic, built after the engine (on every rank of a multi-rank trainer)."""
    exporter: Exporter
    """`export-hf` of a checkpoint this engine wrote (it knows the names and layout its trainer saves)."""
    memory: TrainerMemory
    moe: MoeImpl
    multi_rank: bool = False
    """One trainer process per device, ranks of a torch.distributed group formed before the engine is built
    (trainer/group.py); else one trainer process."""
    parallel: frozenset[ParallelDim] = frozenset()
    """The model-parallel sizes it implements (the others must be 1)."""
    critic_parallel: frozenset[ParallelDim] = frozenset()
    """Those PPO's critic implements too."""
    recompute_block: bool = False
    """trainer.recompute.method block (else every layer is recomputed: uniform)."""
    fused_projections: bool = False
    """Its attention and MLP projections are fused (linear_qkv, linear_fc1): adapters on one of q / k / v or
    gate / up need lora.type canonical_lora."""
    budget_flat_only: bool = False
    """trainer.max_tokens_per_micro_batch only at pipeline = context = 1 (pipeline stages exchange activations
    of one fixed shape, context parallelism shards the sequence)."""
    shared_prompts: bool = False
    """Shared-prompt passes (trainer.shared_prompts)."""
    cuda_graphs: bool = False
    """Training passes recorded as CUDA graphs (trainer.cuda_graphs)."""
    packed_passes: bool = False
    """Passes of packed rows with variable-length attention (trainer.packed_passes)."""
    auto_width_multiple_cuda: int = 1
    """trainer.pass_width_multiple null resolves to this on a CUDA device (1 elsewhere)."""
    smoke: bool = False
    """`rlbridge train --smoke` runs its recipes (the engine's parallel layout is what the smoke run checks)."""
    refused_models: Mapping[str, str] = field(default_factory=dict)
    """config.json model_type -> why this engine cannot train such a model (the recipe checks refuse it with
    the reason: recipe/checks/model.py, check_model_family)."""
    exports_dora: bool = False
    """It exports lora.type dora's weights (every run exports them at its first weight sync to the rollout engine):
    without this the recipe checks refuse DoRA (recipe/checks/training.py, check_lora)."""
    distributed_optimizer_checkpoints: bool = False
    """It checkpoints trainer.distributed_optimizer (every run writes checkpoints: without this the key is
    refused, recipe/checks/checkpoints.py)."""
