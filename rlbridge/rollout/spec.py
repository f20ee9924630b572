"""What a rollout engine is, said once: `RolloutEngineSpec`, one per engine (rollout/vllm_spec.py,
rollout/hf_spec.py), listed in rollout/registry.py.

How its worker is made, and what it supports that the recipe checks, the plan, the trainer and the session
need to know. None of them compares `rollout.engine` to a name. Imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlbridge.recipe.schema import Recipe
    from rlbridge.rollout.base import RolloutEngine


ENGINE_KEYS = (
    "gpu_memory_utilization",
    "kv_cache_gib",
    "float32_head",
    "flashinfer_sampler",
    "enforce_eager",
    "max_num_seqs",
)
"""The rollout keys that tune one engine's internals (vLLM's today); an engine reads those in its `reads`. The
plan and the recipe checks read the memory keys only for an engine that reserves memory (`reserves_memory`)."""


@dataclass(frozen=True)
class RolloutEngineSpec:
    """One rollout engine. The defaults describe an engine without limits or extras: it loads whatever the
    trainer exports, anywhere, reserves nothing up front and never sleeps."""

    name: str
    """The recipe's rollout.engine."""
    worker: Callable[[], type[RolloutEngine]]
    """The worker class (imported when called): made with (model_dir, rollout cfg, model cfg, **worker_kwargs)."""
    worker_kwargs: Callable[[Recipe, int], dict[str, Any]]
    """(recipe, the torch threads it may use on a CPU) -> its keyword arguments."""
    started: str = "model loaded"
    """What its start-up line says is up ("vLLM engine up")."""
    reserves_memory: bool = False
    """It reserves rollout.gpu_memory_utilization of the device up front (weights and KV cache), and on GPUs
    shared with the trainer sleeps through the update and wakes to load weights (rollout/memory.py,
    rollout.sleep); else it allocates as it generates, never sleeps."""
    loads_ipc: bool = False
    """It loads merged weights from CUDA IPC handles (rollout.weight_transport cuda_ipc)."""
    serves_dora: bool = True
    """It serves DoRA adapters (rollout.weight_sync adapter with lora.type dora)."""
    lora_ranks: tuple[int, ...] | None = None
    """The rollout.max_lora_rank values it accepts (None: any)."""
    moe_on_cpu: bool = True
    """It reloads an MoE model's weights correctly on a CPU."""
    routing_replay_on_cpu: bool = True
    """It returns the routed experts (rollout.routing_replay) on a CPU."""
    moe_adapter_sync: bool = True
    """It loads adapter syncs of any MoE model (else of attention adapters on GPUs only)."""
    warm_adapter: bool = False
    """A fresh run on GPUs loads the trainer's initial adapter before the first generation (adapter sync): its
    first generation with an adapter is slower than later ones, and that lands in the warm-up, not in step 3."""
    seeds_per_group: bool = False
    """It samples each prompt group from a seed of its own (`generate(..., group_seeds=...)`), so that several
    engines sample what one does (rollout/group.py); else it takes one seed per call."""
    spreads_tensor_parallel: bool = False
    """At rollout.tensor_parallel > 1 it starts its own workers on the engine's devices, told how by the
    session (launch.engine_specs: executor, ray_bundles, ray_gpus_per_worker)."""
    reads: frozenset[str] = frozenset()
    """The ENGINE_KEYS it reads; the plan notes any other of them a recipe sets (it changes nothing)."""
    stand_in: bool = False
    """The smoke run (`rlbridge train --smoke`) rolls out with it in place of the recipe's engine (cheap to
    start on a CPU, the same weight-sync export)."""
