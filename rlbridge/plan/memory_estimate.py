"""What each device must hold: the plan's memory estimate (trainer weights, gradients, optimizer state and
activations; vLLM's weights and KV cache; a reward model scoring on the GPU; the peak of the fullest phase) and the
notes it leads to.

Rough by design (about +-30 %): for spotting a plan that cannot fit before any GPU is touched. The coefficients
are fitted to measured peaks (docs/defaults.md#plan-memory); the engine-specific ones come from the engine's
spec (`trainer_engine(r).memory`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from rlbridge.engines.registry import trainer_engine
from rlbridge.errors import RlbridgeError
from rlbridge.model.info import ModelInfo, read_model_info
from rlbridge.plan.batches import Batches
from rlbridge.recipe.schema import MAX_GRAPHS, MAX_PASS_TOKENS, Recipe, round_width
from rlbridge.rollout.registry import rollout_engine
from rlbridge.weights import WeightSync

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ALLOCATOR_RESERVE = 1.15
"""On a GPU, what torch's caching allocator holds on the device over the trainer's allocated peak (fitted to
measured device peaks: docs/defaults.md#plan-memory)."""
CONTEXT_GIB = 0.5
"""A CUDA context and its libraries, per process on the device (the trainer's, vLLM's)."""
RESIDENT_SHARE = 0.9
"""rollout.sleep auto: vLLM stays resident through the update where the plan's peak with it resident is at most
this share of the device (the plan's device peak was within 0.96-1.06 of nvidia-smi's in the growth runs)."""
# LoRA (in, out) shapes per Megatron target, as functions of the model shape.
_LORA_SHAPES = {
    "linear_qkv": lambda m: (m.hidden, (m.heads + 2 * m.kv_heads) * m.head_dim),
    "linear_q": lambda m: (m.hidden, m.heads * m.head_dim),
    "linear_k": lambda m: (m.hidden, m.kv_heads * m.head_dim),
    "linear_v": lambda m: (m.hidden, m.kv_heads * m.head_dim),
    "linear_proj": lambda m: (m.heads * m.head_dim, m.hidden),
    "linear_fc1": lambda m: (m.hidden, 2 * (m.moe_intermediate or m.intermediate)),
    "linear_fc1_gate": lambda m: (m.hidden, m.moe_intermediate or m.intermediate),
    "linear_fc1_up": lambda m: (m.hidden, m.moe_intermediate or m.intermediate),
    "linear_fc2": lambda m: (m.moe_intermediate or m.intermediate, m.hidden),
}
_MLP_TARGETS = {"linear_fc1", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"}


@dataclass(frozen=True)
class Memory:
    """Estimated GiB per device. Rough by design (±30%): for spotting a plan that cannot fit."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    trainer_total: float
    rollout_weights: float
    rollout_kv_cache: float
    rollout_total: float
    peak: float
    """Per device: on a GPU what the device holds at the fullest phase (the trainer's allocator reserve and the
    CUDA contexts included: ALLOCATOR_RESERVE, CONTEXT_GIB); on a CPU the host memory of a worker."""
    capacity: float
    trainable_params: int
    total_params: int
    full_ft_trainer_total: float
    """What the trainer would need with full fine-tuning, for comparison under LoRA."""
    rollout_sleeps: bool = False
    """Colocated GPUs in sync mode: vLLM sleeps through the update (rollout.sleep: always, or auto where it does not
    fit resident); False elsewhere. `peak` is for this choice."""
    critic: float = 0.0
    """PPO's critic, included in trainer_total: a second copy of the backbone (weights; under LoRA the frozen
    base again, engines/hf/critic.py), its gradients and AdamW state. No extra activations: its forward and
    backward run after the policy's, per micro-batch, and hold no vocabulary-sized logits."""
    reward_model_weights: float = 0.0
    """The reward models that score on the GPU (reward.terms[].device: cuda): their float32 weights, on the first
    GPU of the driver's node (GPU 0 of node 0), in `peak`; 0 elsewhere."""
    reward_model_activations: float = 0.0
    """Their largest batch's forward (reward_model_gib)."""
    reward_model_total: float = 0.0
    """Weights, activations and the reward worker's CUDA context (CONTEXT_GIB): what `peak` holds for them."""


def lora_params(r: Recipe, m: ModelInfo) -> int:
    from rlbridge.recipe.targets import megatron_targets

    dense = replace(m, moe_intermediate=0)  # the shapes of a dense layer's MLP
    total = 0
    for target in megatron_targets(r.lora.targets, r.lora.type):
        if m.is_moe and target in _MLP_TARGETS:  # one adapter per expert on MoE layers, one on dense layers
            fan_in, fan_out = _LORA_SHAPES[target](m)
            total += m.moe_layers * m.num_experts * r.lora.rank * (fan_in + fan_out)
            fan_in, fan_out = _LORA_SHAPES[target](dense)
            total += m.dense_layers * r.lora.rank * (fan_in + fan_out)
        else:
            fan_in, fan_out = _LORA_SHAPES[target](m)
            total += m.layers * r.lora.rank * (fan_in + fan_out)
    return total


def reward_model_gib(r: Recipe, b: Batches) -> tuple[float, float]:
    """(weights, activations) in GiB of the reward models that score on the GPU (reward.terms[].device: cuda), all
    held by one reward worker on the driver's first GPU (data/reward_pool.py): (0, 0) on a CPU cluster or for
    models on the CPU.

    Weights: float32, the parameters counted from each model's config.json as for the policy (ModelInfo), less an
    untied output layer (a classification head replaces it: hidden x one label). Activations, an estimate (not
    fitted to a measured peak): the worker scores one batch at a time under inference_mode, so the largest model's
    batch of `batch_size` sequences of max_prompt_tokens + max_response_tokens tokens, at 4 bytes x (6 hidden +
    3 intermediate) per token: about one layer's live float32 tensors (residual, norm, q/k/v, attention output;
    the MLP's gate, up and their product), none kept for a backward. A model whose config.json cannot be read
    counts nothing here (validation refuses it: checks/files.py)."""
    if r.cluster.device != "cuda":
        return 0.0, 0.0
    weights = activations = 0.0
    for term in r.reward.resolved_terms():
        if term.model is None or term.device != "cuda":
            continue
        try:
            rm = read_model_info(term.model)
        except RlbridgeError:
            continue
        params = rm.total_params() - (0 if rm.tied_embeddings else rm.vocab * rm.hidden) + rm.hidden
        weights += params * DTYPE_BYTES["float32"] / GIB
        per_token = DTYPE_BYTES["float32"] * (6 * rm.hidden + 3 * rm.mlp_width_per_token())
        activations = max(activations, term.batch_size * b.max_sequence_tokens * per_token / GIB)
    return weights, activations


def rollout_engine_groups(r: Recipe) -> tuple[int, int]:
    """(engine groups, engines per group): a group per rollout.tensor_parallel devices of the rollout's (the
    trainer's when colocated), rollout.engines_per_device engines in each at tensor parallel 1, one above."""
    rtp = r.rollout.tensor_parallel
    return max(r.rollout_devices // rtp, 1), (r.rollout.engines_per_device if rtp == 1 else 1)


def rollout_engine_count(r: Recipe) -> int:
    """Rollout engines in all (rollout_engine_groups)."""
    groups, per_group = rollout_engine_groups(r)
    return groups * per_group


def generation_gib(r: Recipe, m: ModelInfo, b: Batches) -> float:
    """What an engine that allocates as it generates (transformers generate: rollout/hf.py, one left-padded batch)
    holds at the end of a step's generation, in GiB: the KV cache of its share of the rollouts at full length
    (prompt + response, every layer's keys and values in the model's dtype) and the float32 logits of every
    generated position that it keeps for the log-probs (output_logits). An estimate from the shapes, not fitted
    to a measured peak; vLLM's share is rollout.gpu_memory_utilization / kv_cache_gib instead."""
    rollouts = -(-b.rollouts_per_step // rollout_engine_count(r))
    kv = b.max_sequence_tokens * m.layers * 2 * m.kv_heads * m.head_dim * DTYPE_BYTES[r.model.dtype]
    logits = r.rollout.max_response_tokens * m.vocab * DTYPE_BYTES["float32"]
    return rollouts * (kv + logits) / GIB


def memory(r: Recipe, m: ModelInfo, dp: int, b: Batches) -> Memory:
    p = r.trainer.parallel
    wbytes = DTYPE_BYTES[r.model.dtype]
    layers_per_stage = m.layers / p.pipeline
    if m.is_moe:  # a layer's MLP on average: experts shard over EP x ETP, a dense layer's MLP over TP
        moe_share = m.moe_layers / m.layers
        mlp = m.mlp_params() * moe_share / (p.expert * p.expert_tensor)
        mlp += m.dense_mlp_params() * (1 - moe_share) / p.tensor
    else:
        mlp = m.mlp_params() / p.tensor
    stage_params = (
        layers_per_stage * (m.attention_params() / p.tensor + mlp) + m.embedding_params() / p.tensor
    )
    total = m.total_params()
    trainable = lora_params(r, m) if r.lora.enabled else total

    def trainer_gib(trainable_local: float) -> tuple[float, float, float]:
        grads = trainable_local * 4  # fp32 main grads
        opt_bytes = 12 if wbytes < 4 else 8  # fp32 master copy (when params are 16-bit) + Adam m, v
        shard = dp if r.trainer.distributed_optimizer else 1
        return stage_params * wbytes / GIB, grads / GIB, trainable_local * opt_bytes / shard / GIB

    local_trainable = trainable / (p.tensor * p.pipeline) if r.lora.enabled else stage_params
    weights, grads, opt = trainer_gib(local_trainable)
    act = _activations(r, m, b) / GIB
    if r.trainer.cuda_graphs:  # engines/hf/graphs.py: the pool's pass and each recorded shape's gradients
        act += (_activations(r, m, b, cap=MAX_PASS_TOKENS) + MAX_GRAPHS * 4 * local_trainable) / GIB
    rollout_w = total * wbytes / r.rollout.tensor_parallel / GIB
    capacity = r.cluster.gpu_memory_gib
    if not rollout_engine(r).reserves_memory:  # transformers generate: allocates as it generates
        kv = generation_gib(r, m, b)
    elif r.cluster.device == "cpu":  # vLLM-CPU: KV cache of a fixed size in host memory
        kv = r.rollout.kv_cache_gib
    else:  # vLLM takes gpu_memory_utilization of the device; what the weights leave is KV cache
        kv = max(r.rollout.gpu_memory_utilization * capacity - rollout_w, 0.0)
    critic = full_critic = 0.0
    if r.algorithm.has_critic:
        critic, full_critic = _critic_gib(r, m, stage_params / total, trainer_gib)
    trainer_total = weights + grads + opt + act + critic
    _, full_grads, full_opt = trainer_gib(stage_params)
    full_total = weights + full_grads + full_opt + act + full_critic
    # Colocated: vLLM sleeps (weights offloaded, KV cache freed) during the update, so phases do not add up;
    # rollout.mode async keeps it resident while the trainer updates, so they do.
    _, per_device = rollout_engine_groups(r)
    rollout_total = (rollout_w + kv) * per_device  # rollout.engines_per_device engines, each its own copy
    rm_weights, rm_act = reward_model_gib(r, b)
    # the reward worker's GPU (GPU 0 of node 0) is taken for the fullest device: the peak holds its models
    rm_total = rm_weights + rm_act + CONTEXT_GIB if rm_weights else 0.0
    sleeps = False
    if r.cluster.device == "cpu":
        peak = trainer_total + rollout_total
    else:  # the device: the trainer's allocator reserve, and each process's CUDA context
        held = trainer_total * ALLOCATOR_RESERVE
        # vLLM resident through the update (async, or rollout.sleep letting it stay); a CUDA IPC export also
        # holds the merged weights on the trainer's side while vLLM is awake
        ipc = rollout_w if r.rollout.weight_transport == "cuda_ipc" else 0.0
        resident = held + rollout_total + ipc + 2 * CONTEXT_GIB + rm_total
        if not r.cluster.colocate:
            peak = held + CONTEXT_GIB + rm_total
        elif r.rollout.mode == "async":
            peak = resident
        else:
            can_sleep = rollout_engine(r).reserves_memory
            sleeps = can_sleep and (
                r.rollout.sleep == "always"
                or (r.rollout.sleep == "auto" and resident > RESIDENT_SHARE * capacity)
            )
            # asleep: the update (an engine that never sleeps keeps its weights through it), or the generation
            # (the trainer keeps its weights and optimizer state)
            kept = 0.0 if can_sleep else rollout_w * per_device
            asleep = max(held + kept, rollout_total + weights + opt + critic) + 2 * CONTEXT_GIB + rm_total
            peak = resident if can_sleep and not sleeps else asleep
    return Memory(
        round(weights, 3),
        round(grads, 3),
        round(opt, 3),
        round(act, 3),
        round(trainer_total, 3),
        round(rollout_w, 3),
        round(kv, 3),
        round(rollout_total, 3),
        round(peak, 3),
        capacity,
        int(trainable),
        int(total),
        round(full_total, 3),
        sleeps,
        round(critic, 3),
        round(rm_weights, 3),
        round(rm_act, 3),
        round(rm_total, 3),
    )


def _critic_gib(
    r: Recipe, m: ModelInfo, local_share: float, trainer_gib: Callable[[float], tuple[float, float, float]]
) -> tuple[float, float]:
    """(critic GiB as the recipe trains it, critic GiB under full fine-tuning): the backbone (every weight but
    an untied output layer) plus the value head, in model.dtype; gradients and AdamW state for its adapter
    (the policy's LoRA shapes) or for all of it."""
    wbytes = DTYPE_BYTES[r.model.dtype]
    backbone = (m.total_params() - (0 if m.tied_embeddings else m.vocab * m.hidden)) * local_share
    head = m.hidden + 1
    weights = (backbone * wbytes + head * 4) / GIB

    def state(trainable: float) -> float:
        _, grads, opt = trainer_gib(trainable)
        return grads + opt

    full = weights + state(backbone + head)
    if not r.lora.enabled:
        return full, full
    return weights + state(lora_params(r, m) * local_share + head), full


def _activations(r: Recipe, m: ModelInfo, b: Batches, cap: float | None = None) -> float:
    """Bytes one training pass holds for its backward, per device: the layers' saved tensors plus the loss's.

    Per token and layer, in 16-bit bytes (h hidden, I the MLP width a token spans, kv = kv_heads x head_dim):
    the two RMSNorms' inputs and their float32 upcasts, the inputs of the q/k/v, o, gate/up and down projections,
    SDPA's q, k, v and output (no [s, s] scores: both engines use SDPA / flash attention), SwiGLU's gate, up and
    product: `18h + 8I + 4kv` for the hf engine, `18h + 10.6I + 4kv` for megatron (its fused SwiGLU keeps more
    of the MLP). A float32 model holds twice that. Under LoRA on a 16-bit model the hf engine adds peft's float32
    copy of each adapted module's input (4 bytes x its input width: its adapters are float32), unless
    lora.compute_dtype is model (adapters in the model's dtype read the input the base layer saves). The loss holds
    per scored position and vocabulary entry ~8 bytes in the hf engine (float32 logits and their gradient:
    engines/hf/token_stats.py keeps no vocabulary-sized temporary) and ~20 in megatron (float32 logits and their
    transposed copy besides); both fitted to measured peaks (docs/defaults.md#plan-memory). Both score the response
    positions
    only (hf: logits_to_keep; megatron: forward.response_head), megatron every position under sequence or context
    parallelism, where its output layer sees a shard of the sequence (that case is not measured).

    A pass holds micro_batch_size full-length sequences (rounded up to trainer.pass_width_multiple), or with
    trainer.max_tokens_per_micro_batch (either engine) at most max(budget, one longest sequence) tokens, and never more than the rank's whole mini-batch:
    upper bounds, checked against measured peaks (docs/defaults.md#plan-memory). `cap`: passes of
    at most that many positions (trainer.cuda_graphs' memory pool)."""
    p = r.trainer.parallel
    longest = round_width(b.max_sequence_tokens, r.trainer.width_multiple(r.cluster.device))
    s, h = longest / p.context, m.hidden
    budget = r.trainer.max_tokens_per_micro_batch
    tokens = s * r.trainer.micro_batch_size if budget is None else max(budget / p.context, s)
    tokens = min(tokens, s * b.sequences_per_dp_rank)  # a pass holds at most the rank's whole mini-batch
    if cap is not None:  # a pass of at most `cap` positions (trainer.cuda_graphs records no larger one)
        tokens = min(tokens, cap)
    coef = trainer_engine(r).memory
    unit = DTYPE_BYTES[r.model.dtype] / 2
    width = m.mlp_width_per_token()
    per_token = (18 * h + coef.mlp_bytes * width + 4 * m.kv_heads * m.head_dim) * unit / p.tensor
    if coef.lora_input_copies and r.lora.enabled and r.lora.compute_dtype == "float32" and unit < 2:
        per_token += 4 * _lora_input_width(r, m)
    layers = m.layers / p.pipeline
    if r.trainer.recompute.granularity == "full":  # checkpointed layer inputs + one layer recomputed
        act = layers * 2 * unit * tokens * h + per_token * tokens
    else:
        act = layers * per_token * tokens
    in_flight = min(
        p.pipeline, b.micro_batches_per_mini_batch
    )  # 1F1B keeps up to pp micro-batches on stage 0
    response_only = coef.logits_response_only or (
        p.context == 1 and not (p.sequence_parallel and p.tensor > 1)
    )
    share = min((r.rollout.max_response_tokens + 1) / b.max_sequence_tokens, 1.0) if response_only else 1.0
    logits = coef.logits_bytes * tokens * share * m.vocab / p.tensor
    return act * in_flight + logits


def _lora_input_width(r: Recipe, m: ModelInfo) -> float:
    """Per token and layer, the summed input widths of the modules peft adapts (each casts its own float32 copy
    of its input, so q, k and v hold three copies of the same one)."""
    from rlbridge.recipe.targets import hf_targets

    widths = {"o_proj": m.heads * m.head_dim, "down_proj": m.mlp_width_per_token()}
    return float(sum(widths.get(name, m.hidden) for name in hf_targets(r.lora.targets)))


MANY_PASSES = 16
"""From this many passes per optimizer step on a GPU, the plan suggests trainer.max_tokens_per_micro_batch."""


def _budget_note(r: Recipe, m: ModelInfo, dp: int, b: Batches, mem: Memory) -> str | None:
    """On a GPU each training pass costs host time whatever its size (peft's per-module LoRA calls, kernel
    launches): many small passes make the update host-bound. The largest token budget whose trainer fits in
    60 % of the device (beside a resident vLLM in async colocated mode), by this plan: room for the allocator's
    reserve and the plan's error (docs/defaults.md#token-budget). None if none helps."""
    t = r.trainer
    if r.cluster.device != "cuda" or t.max_tokens_per_micro_batch is not None:
        return None
    if b.micro_batches_per_mini_batch < MANY_PASSES or (
        trainer_engine(r).budget_flat_only and (t.parallel.pipeline > 1 or t.parallel.context > 1)
    ):
        return None  # megatron forms budget passes at PP = CP = 1 only
    resident = mem.rollout_total if r.cluster.colocate and r.rollout.mode == "async" else 0.0
    room = 0.6 * mem.capacity - resident
    now = b.max_sequence_tokens * t.micro_batch_size
    for budget in (65536, 32768, 16384, 8192):
        if budget < 2 * now:
            return None
        trial = r.model_copy(update={"trainer": t.model_copy(update={"max_tokens_per_micro_batch": budget})})
        gib = memory(trial, m, dp, b).trainer_total
        if gib <= room:
            passes = math.ceil(b.sequences_per_dp_rank * b.max_sequence_tokens / budget)
            return (
                f"the update runs {b.micro_batches_per_mini_batch} passes of {t.micro_batch_size} sequences per "
                f"optimizer step, host-bound on a GPU: trainer.max_tokens_per_micro_batch: {budget} runs at most "
                f"{passes} (trainer ~{gib:.1f} GiB by this plan; 512 rollouts of SmolLM2: update "
                "16.6 s -> 1.5 s, docs/defaults.md#token-budget)"
            )
    return None


SHARED_PEAK = 1.2
"""The trainer's peak with trainer.shared_prompts always against the plain passes, on a GPU (an upper bound of the
measured ratios: docs/defaults.md#shared-prompts): each layer's prompt keys and values gathered
per row and concatenated with the responses' (two copies kept for the backward). Not modeled term by term: a note,
not the estimate."""


def _shares_prompts_on_a_gpu(r: Recipe) -> bool:
    """The hf engine runs the padded shared-prompt passes on a GPU: shared_prompts always (auto shares on CPUs only),
    more than one response per prompt, no activation recompute (engines/hf/shared_prompts.py); not packed passes,
    which share prompts through their attention segments and keep no KV cache (engines/hf/varlen.py)."""
    t = r.trainer
    return (
        r.cluster.device == "cuda"
        and trainer_engine(r).shared_prompts
        and t.shared_prompts == "always"
        and not t.packed_passes
        and r.rollout.n > 1
        and t.recompute.granularity == "none"
    )


LARGE_MERGED_GIB = 8.0
"""Merged weights from this size on get the plan's host-memory note (_merged_files_note)."""


def _merged_files_note(r: Recipe, mem: Memory) -> str | None:
    """GPUs, merged weights through files: each sync writes the whole model into /dev/shm (host memory) on
    every node, beside vLLM's sleep offload of its own weights (weights/directory.py falls back to the temp dir
    on disk where /dev/shm has no room). Said for large models, with what avoids it."""
    ro = r.rollout
    if r.cluster.device != "cuda" or ro.weight_sync != WeightSync.MERGED or ro.weight_transport != "files":
        return None
    gib = mem.total_params * DTYPE_BYTES[r.model.dtype] / GIB
    if gib < LARGE_MERGED_GIB:
        return None
    offload = " beside vLLM's sleep offload of its weights" if mem.rollout_sleeps else ""
    fixes = ["rollout.weight_sync adapter (the adapters only)"] if r.lora.enabled else []
    if r.cluster.colocate and r.cluster.nodes == 1 and ro.tensor_parallel == 1:
        fixes.append("rollout.weight_transport cuda_ipc (no files)")
    if not fixes:
        fixes.append("a node whose /dev/shm holds it")
    return (
        f"rollout.weight_sync merged: each sync writes the merged model ({gib:.1f} GiB) into /dev/shm, host "
        f"memory, on every node{offload} (on disk, slower, where /dev/shm has no room); "
        f"{' or '.join(fixes)} avoids it"
    )


def memory_notes(r: Recipe, m: ModelInfo, dp: int, b: Batches, mem: Memory) -> list[str]:
    """The plan's notes from its memory estimate: a peak past the device, a token budget that would make the
    update less host-bound, a large merged sync's host memory, the shared-prompt passes' higher peak."""
    notes = []
    if r.cluster.device == "cuda" and mem.peak > mem.capacity:
        notes.append(f"estimated peak {mem.peak:.1f} GiB exceeds the {mem.capacity:.0f} GiB per device")
    note = _budget_note(r, m, dp, b, mem)
    if note:
        notes.append(note)
    note = _merged_files_note(r, mem)
    if note:
        notes.append(note)
    if _shares_prompts_on_a_gpu(r):
        notes.append(
            f"trainer.shared_prompts always on a GPU: these figures are the plain passes'; with shared prompts "
            f"the trainer's measured peak was 1.12-1.18x theirs (expect up to ~{SHARED_PEAK * mem.trainer_total:.1f}"
            f" GiB) and the update slower (0.47-0.90x; docs/defaults.md#shared-prompts)"
        )
    return notes
