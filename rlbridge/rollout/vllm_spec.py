"""The vLLM rollout engine as the rest of rlbridge sees it (rollout/spec.py); the engine is rollout/vllm.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlbridge.rollout.spec import ENGINE_KEYS, RolloutEngineSpec

if TYPE_CHECKING:
    from rlbridge.recipe.schema import Recipe
    from rlbridge.rollout.base import RolloutEngine

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for max_lora_rank (vllm/config/lora.py)."""


def _worker() -> type[RolloutEngine]:
    from rlbridge.rollout.vllm import VllmRollout

    return VllmRollout


def decode_rows(r: Recipe) -> int:
    """The most sequences one engine is asked to generate in one call: a step's rollouts (all of them at one
    engine; several engines share them) or, with validation data, an evaluation's (run.eval_samples prompts, k
    completions each for pass@k)."""
    k = max((m.k for m in r.eval.metrics), default=1)
    return max(r.rollouts_per_step, r.run.eval_samples * k if r.data.val is not None else 0)


def _kwargs(r: Recipe, threads: int) -> dict[str, Any]:
    cpu = r.cluster.device == "cpu"
    return {
        "seed": r.run.seed,
        "lora_rank": r.lora.rank,
        "cpu": cpu,
        **({"num_threads": threads} if cpu else {"max_batch": decode_rows(r)}),
    }


VLLM = RolloutEngineSpec(
    name="vllm",
    worker=_worker,
    worker_kwargs=_kwargs,
    started="vLLM engine up",
    reserves_memory=True,
    loads_ipc=True,
    serves_dora=False,
    lora_ranks=VLLM_LORA_RANKS,
    moe_on_cpu=False,  # its CPU build reloads an MoE model's weights in place wrongly
    routing_replay_on_cpu=False,  # enable_return_routed_experts needs Model Runner V2, which needs Triton
    moe_adapter_sync=False,  # LoRA on fused MoE layers: not on its CPU build, not verified for experts on GPUs
    warm_adapter=True,
    seeds_per_group=True,
    spreads_tensor_parallel=True,
    reads=frozenset(ENGINE_KEYS),
)
