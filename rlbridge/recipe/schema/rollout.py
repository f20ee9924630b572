"""The recipe's `rollout` section: the generation engine, sampling, how weights reach it and how it shares the
devices with the trainer."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlbridge.recipe.schema.base import PositiveInt, Section, enum_key
from rlbridge.weights import WeightSync


class RolloutCfg(Section):
    engine: Literal["vllm", "hf"] = "vllm"
    """Rollout engine: vllm (CUDA or CPU build) or hf (transformers.generate)."""
    n: PositiveInt = 4
    """Completions sampled per prompt (the group size of GRPO-family algorithms)."""
    tensor_parallel: PositiveInt = 1
    """Tensor-parallel size of each vLLM engine: raise it when one GPU cannot hold the model and its KV cache."""
    engines_per_device: PositiveInt = 1
    """Rollout engines sharing each rollout device (tensor_parallel 1 only). A small model's one engine can leave
    a large GPU's compute idle; two engines each take rollout.gpu_memory_utilization of the device, so lower it
    (e.g. 0.3 each) until all of them and, colocated, the trainer fit: `rlbridge plan` shows the peak."""
    temperature: Annotated[float, Field(ge=0)] = 1.0
    """Sampling temperature. 1.0 samples from the policy the trainer scores (its log-probs are not tempered);
    lower values explore less."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling; -1 turns it off."""
    max_prompt_tokens: PositiveInt = 512
    """Prompts longer than this are filtered out (counted and reported)."""
    max_response_tokens: PositiveInt = 512
    """Maximum generated tokens per completion. Longer allows longer reasoning at a cost that grows with it in
    generation, the update and memory (`rlbridge plan` shows the memory)."""
    ignore_eos: bool = False
    """Training samples go on past the end-of-sequence token to max_response_tokens (vLLM's ignore_eos; the hf
    engine suppresses EOS until then): every response has exactly that length. For measuring step time and memory
    at a given response length (bench/growth.py); it changes what the policy learns from. Evaluation (greedy) still
    stops at EOS."""
    weight_sync: WeightSync = enum_key(WeightSync.MERGED, "Weight Sync")
    """How trained weights reach the rollout: merged full weights, or a LoRA adapter (needs lora.rank > 0)."""
    weight_transport: Literal["files", "cuda_ipc"] = "files"
    """How merged weights travel from the trainer to vLLM on the same node: files (a safetensors directory in
    /dev/shm that vLLM reloads; in the temp dir on disk, with a warning, where /dev/shm has too little room, as a
    container's default 64 MB; an error before anything is written where neither has) or cuda_ipc (a colocated
    CUDA trainer shares its GPU tensors with vLLM by CUDA IPC handles, no copy through host memory; needs
    cluster.device cuda, colocate, one node, rollout.engine vllm at tensor_parallel 1, weight_sync merged and a
    trainer of one process). Same log-probs as files, faster for large
    weights (tests/gpu/test_gpu_ipc_sync.py; docs/defaults.md#cuda-ipc)."""
    max_lora_rank: PositiveInt = 64
    """vLLM's max_lora_rank; must be >= lora.rank when weight_sync is adapter."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.8
    """Fraction of GPU memory vLLM may take (weights + KV cache). On CPU see kv_cache_gib."""
    sleep: Literal["always", "auto", "never"] = "always"
    """Colocated GPUs, sync mode: whether vLLM sleeps through the update (weights offloaded, KV cache freed) and
    wakes for the weight sync. always: every step (the trainer gets the whole device). never: vLLM stays resident
    next to the trainer, which saves the sleep and wake (a tenth of a second or more a step; more for a large
    model's weights) and the trainer's cache release after each update. auto: resident when `rlbridge plan`'s
    peak with vLLM resident is at most 90 % of cluster.gpu_memory_gib, else as always. `rlbridge plan` says which
    it chose (tests/gpu/test_gpu_async.py::test_sync_mode_with_vllm_resident; async mode always keeps vLLM
    resident).
    Set auto or never on a single GPU where both fit (docs/defaults.md#vllm-resident)."""
    kv_cache_gib: Annotated[float, Field(gt=0)] = 1.0
    """CPU build of vLLM only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    float32_head: bool = True
    """A 16-bit model's output layer (lm_head) computes in float32 in vLLM (`hf_overrides` head_dtype), as it does
    in both trainers: rounding logits in the tens to bf16 alone moves log p by hundredths, most of the
    trainer-vs-rollout gap (docs/defaults.md#float32-head). Costs a float32 copy of the
    output layer's weight; turn it off only to save that memory. A vLLM build without head_dtype for generation
    models keeps its bf16 head and says so in the rollout log."""
    routing_replay: bool = False
    """Mixture-of-experts models only: record the experts the rollout engine routed every token to (prompt and
    response, each MoE layer's top-k) and make the trainer's forwards (old, reference and training log-probs)
    use them instead of its own router's choice, so both sides route alike even where a rounding difference
    flips a near-tied expert (docs/moe.md). The router's weights over the given experts are still its own.
    Works with rollout.engine hf on any device and vllm on GPUs; vLLM's CPU build cannot return routed experts."""
    flashinfer_sampler: bool = False
    """vLLM's FlashInfer top-k/top-p sampling kernels (VLLM_USE_FLASHINFER_SAMPLER). They are compiled with nvcc
    the first time an engine starts on a machine, a silent step of minutes on a fresh machine
    (docs/defaults.md#vllm-start-up). Off: vLLM's PyTorch sampler, no compilation; with
    top_p = 1 and top_k = -1 (no filter) vLLM samples natively either way. An environment variable
    VLLM_USE_FLASHINFER_SAMPLER set by the user wins."""
    enforce_eager: bool | None = None
    """vLLM without torch.compile and CUDA graphs. null: eager on CPU, compiled on GPUs. true on a GPU starts
    the engine in seconds instead of minutes (torch.compile and CUDA-graph capture skipped) and generates slower;
    good for tests and short debugging runs (docs/defaults.md#vllm-start-up)."""
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    """vLLM's max_num_seqs: the most sequences one engine decodes at once. On a GPU it also bounds the CUDA graphs
    vLLM captures while it starts (batch sizes up to twice this; with adapter sync, the LoRA graphs only), so a
    value near the rollouts an engine generates per step (data.batch_size x rollout.n / engines) captures fewer
    sizes than vLLM's default (256) and starts sooner. Below that number an engine generates a step in waves
    (`rlbridge plan` notes it). null: vLLM's default."""
    gpus: Annotated[int, Field(ge=1)] | None = None
    """Devices for the rollout when cluster.colocate is false (default: as many as the trainer)."""
    mode: Literal["sync", "async"] = "sync"
    """sync: each step generates with the newest weights, then trains on them. async: the rollout generates the
    next steps' batches while the trainer updates, with weights at most max_staleness versions old
    (docs/async.md); on one GPU vLLM then stays resident next to the trainer (no sleep)."""
    max_staleness: Annotated[int, Field(ge=0)] = 1
    """async only: step j trains on samples generated with weight version j - 1 - max_staleness (the newest the
    rollout has while the trainer is max_staleness updates ahead); never older. Above 1 needs an off-policy
    correction (algorithm.rollout_correction)."""

    @property
    def ahead(self) -> int:
        """Steps the rollout generates ahead of the trainer: 0 (sync) or max_staleness (async)."""
        return self.max_staleness if self.mode == "async" else 0
