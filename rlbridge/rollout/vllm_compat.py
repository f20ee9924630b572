"""What rlbridge asks of vLLM and how it reads vLLM's answers, build by build: the `vllm.LLM(...)` arguments
and the environment for a recipe (why each setting: rollout/vllm.py's module docstring), and the differences
between the vLLM builds rlbridge runs on. Pure: no vLLM import, so tests/unit/rollout/test_vllm_compat.py calls every
branch with stand-ins of both builds' signatures; rollout/vllm.py, the only module that imports vLLM, builds
the engine from these."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbridge.recipe.schema import ModelCfg, RolloutCfg
from rlbridge.rollout.vllm_spec import VLLM_LORA_RANKS
from rlbridge.weights import WeightSync

log = logging.getLogger(__name__)

GIB = 1024**3
WORKER_EXTENSION = "rlbridge.rollout.vllm.WorkerExtension"
FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"
"""Set from rollout.flashinfer_sampler: FlashInfer's sampling kernels are JIT-compiled on a machine's first start."""
CPU_STEP_TOKENS = 4096
"""vLLM-CPU's default token budget of one engine step (max_num_batched_tokens, LLM class)."""
CPU_BLOCK_SIZE = 32
"""KV-cache block size on vLLM-CPU, whose default is 128: its attention walks whole blocks, so short sequences
(a 48-token prompt + <= 48 tokens all fit in one 128-token block) pay for empty slots in every decode step. The
smallest size its CPU attention accepts (a multiple of 32); generation is faster at 32 for short and long
sequences alike (docs/defaults.md#vllm-on-the-cpu)."""
GRAPH_SIZE_CEILING = 512
"""vLLM's own ceiling on the batch sizes it captures CUDA graphs for (max_cudagraph_capture_size's default)."""


LORA_GRAPHS_FOR_NO_ADAPTER = False
"""vLLM's cudagraph_specialize_lora for an engine that serves the run's adapter: by default vLLM captures each batch
size twice, with and without an active LoRA adapter. An adapter-sync engine loads the run's adapter before its
first generation and serves it on every request, so the graphs without one are never replayed: capturing only the
LoRA ones halves the capture at start-up (docs/defaults.md#vllm-start-up). A batch without an adapter would run
eagerly (vLLM's dispatch finds no graph for it), with the same results."""


def graph_capture_size(max_batch: int) -> int:
    """The largest batch the engine captures CUDA graphs for, given the most sequences it decodes at once:
    max_batch rounded up onto vLLM's grid of capture sizes (1, 2, 4, multiples of 8 below 256, of 16 from 256),
    at most vLLM's ceiling. vLLM captures every size of its grid up to this one at start-up (with an adapter: the
    LoRA graph only, LORA_GRAPHS_FOR_NO_ADAPTER); its default goes to 512 whatever the run decodes, most of it for
    batches the run never has."""
    if max_batch <= 4:
        return 1 << (max_batch - 1).bit_length() if max_batch > 0 else 1
    step = 8 if max_batch <= 256 else 16
    return min(-(-max_batch // step) * step, GRAPH_SIZE_CEILING)


# ------------------------------------------------------------------------------------------------------
# vLLM version differences, all in one place. Tested builds: vLLM 0.26.0 (CUDA, the GPU machines) and
# vllm-cpu 0.32.0 (the CPU machines). Each difference is handled by looking at the API itself (not at a
# version string), so a build in between works if it has either shape; tests/unit/rollout/test_vllm_compat.py
# calls every branch with stand-ins of both signatures.
#
# | what                                | 0.26.0 (CUDA)                     | 0.32.0 (CPU)                          |
# |-------------------------------------|-----------------------------------|---------------------------------------|
# | vllm.utils.torch_utils.set_random_seed | (seed)                         | (seed, data_parallel_index)           |
# | float32 lm_head (hf_overrides head_dtype) | accepted; trainer-vs-rollout gap | ModelConfig.head_dtype, honoured     |
# |                                     | 3.8e-2 -> 2.7e-2 on the GPU quickstart |                                   |
# | merged reload into a LoRA engine    | fails (tied embedding wrapped as   | works                                 |
# |                                     | embed_tokens.base_layer)           | (rlbridge never does it: weight_sync  |
# |                                     |                                    |  picks a LoRA engine or a plain one)  |
# ------------------------------------------------------------------------------------------------------


def head_dtype(llm: Any, model_dtype: str) -> str:
    """The output layer's dtype in force: vLLM 0.32 has ModelConfig.head_dtype, which honours
    hf_overrides={"head_dtype": "float32"} for generation models; a build without it computes the head in the
    model dtype."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    value = getattr(config, "head_dtype", None)
    return str(value).removeprefix("torch.") if value is not None else model_dtype


def reseed(set_random_seed: Any, seed: int, data_parallel_index: int = 0) -> None:
    """Call vLLM's `set_random_seed` with the arguments this build takes. 0.26 seeds one stream per process
    (its data-parallel ranks are processes of their own); 0.32 offsets the stream by the data-parallel
    index itself. The seed is reduced to numpy's range (< 2**32) either way."""
    import inspect

    seed = int(seed) % 2**32
    params = inspect.signature(set_random_seed).parameters
    if len(params) >= 2:
        set_random_seed(seed, data_parallel_index)
    else:
        set_random_seed(seed)


def sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from a completion's `logprobs` (asked with logprobs=0: the sampled token only
    at each position). vLLM's FlatLogprobs (flat_logprobs=True) holds them as one flat list; a list of
    {token: Logprob} dicts (vLLM without flat_logprobs) is read position by position."""
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and list(getattr(logprobs, "token_ids", ())) == ids:
        return [float(x) for x in flat]
    return [float(step[tok].logprob) for step, tok in zip(logprobs, ids, strict=True)]


def routed_experts(completion: Any, num_positions: int) -> Any:
    """vLLM's `CompletionOutput.routed_experts` ([prompt + generated positions, MoE layers, k]; an array) as an
    int16 tensor of `num_positions` rows (a missing last row repeats the one before: never scored)."""
    import numpy as np
    import torch

    routed = getattr(completion, "routed_experts", None)
    if routed is None:
        raise RuntimeError(
            "rollout.routing_replay: this vLLM returned no routed_experts (needs enable_return_routed_experts "
            "and Model Runner V2; seen working on vLLM 0.26 CUDA, not on the CPU build)"
        )
    t = torch.from_numpy(np.asarray(routed).astype(np.int16))
    if t.dim() != 3 or t.shape[0] < num_positions - 1:
        raise RuntimeError(
            f"routed_experts of shape {tuple(t.shape)} for a sample of {num_positions} positions"
        )
    return (
        torch.cat([t, t[-1:].expand(num_positions - t.shape[0], -1, -1)])
        if t.shape[0] < num_positions
        else t[:num_positions]
    )


def engine_kwargs(
    model_dir: str | Path,
    rollout_cfg: RolloutCfg,
    model_cfg: ModelCfg,
    *,
    lora_rank: int,
    seed: int,
    cpu: bool,
    executor: str | None = None,
    max_batch: int | None = None,
) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments for a recipe (pure: testable without vLLM). executor: vLLM's
    distributed_executor_backend at tensor_parallel > 1 ("mp" or "ray"; see rollout/vllm.py's docstring).
    max_batch: the most sequences the run decodes at once (rollout/vllm_spec.decode_rows); with CUDA graphs and
    no rollout.max_num_seqs (from which vLLM derives its own bound), graphs are captured up to that batch only."""
    adapter = rollout_cfg.weight_sync == WeightSync.ADAPTER
    if adapter and not 0 < lora_rank <= rollout_cfg.max_lora_rank:
        raise ValueError(
            f"rollout.weight_sync=adapter needs 0 < lora.rank <= rollout.max_lora_rank "
            f"(got lora.rank={lora_rank}, max_lora_rank={rollout_cfg.max_lora_rank})"
        )
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=model_cfg.dtype,
        max_model_len=rollout_cfg.max_prompt_tokens + rollout_cfg.max_response_tokens,
        tensor_parallel_size=rollout_cfg.tensor_parallel,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
        seed=seed,
        logprobs_mode="raw_logprobs",
        enable_lora=adapter,
        worker_extension_cls=WORKER_EXTENSION,
        enforce_eager=cpu if rollout_cfg.enforce_eager is None else rollout_cfg.enforce_eager,
    )
    if rollout_cfg.max_num_seqs is not None:
        kwargs["max_num_seqs"] = rollout_cfg.max_num_seqs
    if rollout_cfg.routing_replay:  # CompletionOutput.routed_experts (vLLM 0.26 CUDA; not the CPU build)
        kwargs["enable_return_routed_experts"] = True
    if rollout_cfg.float32_head and model_cfg.dtype in ("bfloat16", "float16"):
        kwargs["hf_overrides"] = {"head_dtype": "float32"}
    if adapter:
        kwargs.update(max_lora_rank=_vllm_lora_rank(rollout_cfg.max_lora_rank), max_loras=2)
    if executor is not None and rollout_cfg.tensor_parallel > 1:
        kwargs["distributed_executor_backend"] = executor
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(rollout_cfg.kv_cache_gib * GIB)
        kwargs["block_size"] = CPU_BLOCK_SIZE
        # per-request seeds (group_seeds) need unchunked prefills on CPU: see rollout/vllm.py's docstring
        kwargs["enable_chunked_prefill"] = False
        # no more tokens per scheduler step than max_num_seqs sequences can fill (vLLM warns otherwise)
        seqs = rollout_cfg.max_num_seqs
        step_tokens = (
            CPU_STEP_TOKENS if seqs is None else min(CPU_STEP_TOKENS, seqs * kwargs["max_model_len"])
        )
        kwargs["max_num_batched_tokens"] = max(step_tokens, kwargs["max_model_len"])
    else:
        kwargs["enable_sleep_mode"] = True
        graphs: dict[str, Any] = {}
        if max_batch and not kwargs["enforce_eager"] and rollout_cfg.max_num_seqs is None:
            graphs["max_cudagraph_capture_size"] = graph_capture_size(max_batch)
        if adapter and not kwargs["enforce_eager"]:
            graphs["cudagraph_specialize_lora"] = LORA_GRAPHS_FOR_NO_ADAPTER
        if graphs:
            kwargs["compilation_config"] = graphs
    return kwargs


def engine_env(rollout_cfg: RolloutCfg, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment variables the engine needs from the recipe (pure). A variable the user set is kept as is
    (and noted when it differs from the recipe)."""
    want = {FLASHINFER_SAMPLER_ENV: "1" if rollout_cfg.flashinfer_sampler else "0"}
    out = {}
    for key, value in want.items():
        if key not in environ:
            out[key] = value
        elif environ[key] != value:
            log.info("%s=%s from the environment wins over the recipe (%s)", key, environ[key], value)
    return out


def _vllm_lora_rank(rank: int) -> int:
    """rollout.max_lora_rank rounded up to a value vLLM accepts (it is a capacity, not the adapter's rank)."""
    allowed = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if allowed is None:
        raise ValueError(f"rollout.max_lora_rank={rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
    if allowed != rank:
        log.warning("rollout.max_lora_rank=%d is not a vLLM LoRA size; using %d", rank, allowed)
    return allowed
