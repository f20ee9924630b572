"""LoRA and weight sync, the algorithm, rollout correction, asynchronous rollouts."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rlbridge.engines.registry import trainer_engine, trainer_engines_that
from rlbridge.errors import RecipeIssue
from rlbridge.model.info import ModelInfo
from rlbridge.recipe.checks.checkpoints import unsaved_layouts
from rlbridge.recipe.checks.common import VLLM_LORA_RANKS, Issues
from rlbridge.recipe.schema import Recipe
from rlbridge.recipe.targets import (
    CANONICAL_ONLY,
    unknown_targets,
)
from rlbridge.rollout.registry import rollout_engine, rollout_engines_that
from rlbridge.weights import WeightSync

if TYPE_CHECKING:
    from collections.abc import Callable

    from rlbridge.plan import Memory

# ----------------------------------------------------------------------------------- LoRA / sync


def check_lora(r: Recipe, out: Issues) -> None:
    lora, ro = r.lora, r.rollout
    if lora.enabled and lora.type == "dora" and not trainer_engine(r).exports_dora:
        out.append(
            RecipeIssue(
                "lora.type",
                f"trainer.engine {r.trainer.engine} cannot export DoRA weights (its exporter leaves out DoRA's "
                "magnitude vector, so the merge would be wrong), and every run exports them to the rollout engine "
                "at its first weight sync",
                value="dora",
                fix=f"set lora.type: lora, or trainer.engine: {trainer_engines_that(lambda e: e.exports_dora)}",
            )
        )
    if ro.weight_sync == WeightSync.ADAPTER:
        if not lora.enabled:
            out.append(
                RecipeIssue(
                    "rollout.weight_sync",
                    "adapter weight sync needs LoRA (lora.rank > 0)",
                    value="adapter",
                    fix="set rollout.weight_sync: merged, or lora.rank > 0",
                )
            )
        elif lora.rank > ro.max_lora_rank:
            out.append(
                RecipeIssue(
                    "lora.rank",
                    f"LoRA rank {lora.rank} is greater than rollout.max_lora_rank {ro.max_lora_rank}",
                    fix=f"set rollout.max_lora_rank to {min(v for v in VLLM_LORA_RANKS if v >= lora.rank)}",
                )
            )
        if lora.type == "dora" and not rollout_engine(r).serves_dora:
            out.append(
                RecipeIssue(
                    "lora.type",
                    "vLLM cannot serve DoRA adapters",
                    value="dora",
                    fix="set rollout.weight_sync: merged",
                )
            )
        ranks = rollout_engine(r).lora_ranks
        if ranks is not None and ro.max_lora_rank not in ranks:
            out.append(
                RecipeIssue(
                    "rollout.max_lora_rank",
                    f"vLLM accepts max_lora_rank in {ranks}",
                    value=str(ro.max_lora_rank),
                    fix=f"set rollout.max_lora_rank: {min(v for v in VLLM_LORA_RANKS if v >= ro.max_lora_rank) if ro.max_lora_rank <= 512 else 512}",
                )
            )
    if not lora.enabled:
        return
    bad = unknown_targets(lora.targets)
    if bad:
        out.append(
            RecipeIssue(
                "lora.targets",
                f"unknown target(s) {', '.join(bad)}",
                fix="use linear_qkv, linear_proj, linear_fc1, linear_fc2 (or HF names q_proj, ..., down_proj, or all-linear)",
            )
        )
    split = sorted(set(lora.targets) & CANONICAL_ONLY)
    if split and lora.type != "canonical_lora" and trainer_engine(r).fused_projections:
        out.append(
            RecipeIssue(
                "lora.targets",
                f"{', '.join(split)} exist only with lora.type canonical_lora",
                fix="set lora.type: canonical_lora, or use linear_qkv / linear_fc1",
            )
        )


def check_weight_transport(r: Recipe, out: Issues) -> None:
    """rollout.weight_transport cuda_ipc: the trainer hands vLLM CUDA IPC handles of its merged tensors, which only
    a vLLM worker in another process on the same GPU can open, and which must cover the whole model."""
    ro, c = r.rollout, r.cluster
    if ro.weight_transport != "cuda_ipc":
        return
    why = "rollout.weight_transport cuda_ipc shares the trainer's GPU tensors with vLLM on the same GPU"
    fix_files = "or rollout.weight_transport: files"
    needs: list[tuple[str, bool, str, str, str]] = [  # (key, broken, value, reason, fix)
        ("cluster.device", c.device != "cuda", c.device, "CUDA IPC needs CUDA devices", "set cluster.device: cuda"),
        ("cluster.colocate", not c.colocate, "false", "it needs the trainer and vLLM on the same GPU",
         "set cluster.colocate: true"),
        ("cluster.nodes", c.nodes != 1, str(c.nodes), "IPC handles open on the node that made them only",
         "set cluster.nodes: 1"),
        ("cluster.address", c.address is not None, str(c.address),
         "on an existing Ray cluster the rollout may land on another node", "remove cluster.address"),
        ("rollout.engine", not rollout_engine(r).loads_ipc, ro.engine,
         "only the vLLM rollout loads weights from IPC handles",
         f"set rollout.engine: {rollout_engines_that(lambda e: e.loads_ipc)}"),
        ("rollout.weight_sync", ro.weight_sync != WeightSync.MERGED, ro.weight_sync,
         "it moves merged weights (an adapter is small: files cost little)", "set rollout.weight_sync: merged"),
        ("rollout.tensor_parallel", ro.tensor_parallel != 1, str(ro.tensor_parallel),
         "one vLLM worker must hold the whole model on the trainer's GPU", "set rollout.tensor_parallel: 1"),
        ("rollout.engines_per_device", ro.engines_per_device != 1, str(ro.engines_per_device),
         "the trainer hands its tensors to one engine", "set rollout.engines_per_device: 1"),
        ("cluster.gpus_per_node", c.nodes == 1 and c.gpus_per_node != 1, str(c.gpus_per_node),
         "one trainer process must hold the whole merged model on the rollout's GPU (a multi-rank trainer's "
         "export is gathered on rank 0; not supported with IPC yet)", "set cluster.gpus_per_node: 1"),
    ]  # fmt: skip
    for key, broken, value, reason, fix in needs:
        if broken:
            out.append(RecipeIssue(key, f"{why}: {reason}", value=value, fix=f"{fix}, {fix_files}"))


# ---------------------------------------------------------------------------------------- algorithm
def check_algorithm(r: Recipe, out: Issues) -> None:
    algo = r.algorithm
    if algo.name != "ppo":
        return
    spec = trainer_engine(r)
    if spec.parallel - spec.critic_parallel:  # megatron: the value head reads the full, TP-replicated states
        par = r.trainer.parallel
        for key, value, what in (
            ("pipeline", par.pipeline, "a pipeline"),
            ("context", par.context, "a context-parallel layout"),
        ):
            if value > 1 and key not in spec.critic_parallel:
                out.append(
                    RecipeIssue(
                        f"trainer.parallel.{key}",
                        f"PPO's critic on the megatron engine does not support {what} yet",
                        value=str(value),
                        fix=f"set trainer.parallel.{key}: 1 (tensor and data parallelism work), or trainer.engine: hf",
                    )
                )
        if par.sequence_parallel:
            out.append(
                RecipeIssue(
                    "trainer.parallel.sequence_parallel",
                    "PPO's critic on the megatron engine needs the full hidden "
                    "states on every tensor-parallel rank",
                    value="true",
                    fix="set trainer.parallel.sequence_parallel: false",
                )
            )
        if r.trainer.bridge != "megatron-bridge":
            out.append(
                RecipeIssue(
                    "trainer.bridge",
                    "PPO's critic on the megatron engine is built through Megatron-Bridge",
                    value=r.trainer.bridge,
                    fix="set trainer.bridge: megatron-bridge",
                )
            )
    if algo.adaptive_kl_target is not None and (algo.kl.where != "reward" or algo.kl.coef == 0):
        out.append(
            RecipeIssue(
                "algorithm.adaptive_kl_target",
                f"the adaptive KL controller moves the KL penalty in the reward, starting from kl.coef "
                f"(kl.where is {algo.kl.where}, kl.coef is {algo.kl.coef})",
                value=str(algo.adaptive_kl_target),
                fix="set algorithm.kl.where: reward and algorithm.kl.coef > 0 (e.g. 0.05), or remove adaptive_kl_target",
            )
        )


def check_rollout_correction(r: Recipe, out: Issues) -> None:
    rc, key = r.algorithm.rollout_correction, "algorithm.rollout_correction"
    low, high = r.run.health.is_weight_range
    if not low < 1.0 < high:
        out.append(
            RecipeIssue(
                "run.health.is_weight_range",
                "the range must hold 1 (trainer and rollout agree) strictly inside",
                value=f"[{low}, {high}]",
                fix="set run.health.is_weight_range: [0.5, 2.0]",
            )
        )
    if rc.bypass:
        for name, on in (
            ("weights", rc.weights != "none"),
            ("mask_band", rc.mask_band is not None),
            ("reject", rc.reject is not None),
        ):
            if on:
                out.append(
                    RecipeIssue(
                        f"{key}.{name}",
                        "bypass takes the old log-probs from the rollout, so there is no trainer "
                        "log-prob to weigh, mask or reject by (the PPO ratio against the rollout corrects instead)",
                        fix=f"remove {key}.{name}, or set {key}.bypass: false",
                    )
                )
    # judged by value against the default, not by whether the key was written: the resolved recipe in a run
    # directory writes every default out, and `rlbridge resume` must accept it (test_resume_unit)
    default = type(rc)()
    if rc.weights == "none" and rc.clamp_high not in (None, default.clamp_high):
        out.append(
            RecipeIssue(
                f"{key}.clamp_high",
                "clamp_high truncates importance weights, and weights is none",
                value=str(rc.clamp_high),
                fix=f"set {key}.weights: token (or sequence), or remove clamp_high",
            )
        )
    if rc.mask_level != default.mask_level and rc.mask_band is None:
        out.append(
            RecipeIssue(
                f"{key}.mask_level",
                "mask_level says how mask_band judges, and there is no mask_band",
                value=rc.mask_level,
                fix=f"set {key}.mask_band (e.g. [0.5, 2.0]), or remove mask_level",
            )
        )
    if rc.mask_band is not None:
        low, high = rc.mask_band
        if not low < 1.0 < high:
            out.append(
                RecipeIssue(
                    f"{key}.mask_band",
                    "the band must hold 1 (trainer and rollout agree) strictly inside: "
                    "low < 1 < high, else it masks agreeing tokens",
                    value=f"[{low}, {high}]",
                    fix=f"set {key}.mask_band: [{min(low, 0.5)}, {max(high, 2.0)}]",
                )
            )
        elif rc.weights != "none" and rc.clamp_high is not None and rc.clamp_high >= high:
            out.append(
                RecipeIssue(
                    f"{key}.clamp_high",
                    f"clamp_high {rc.clamp_high} is at or above mask_band's high {high}: "
                    "weights that high are masked before the clamp could act",
                    value=str(rc.clamp_high),
                    fix=f"set {key}.clamp_high below {high}, or to null",
                )
            )


def check_async(r: Recipe, out: Issues) -> None:
    """rollout.mode async (docs/async.md): what the overlapped pipeline cannot do, and the staleness bound."""
    ro, rc = r.rollout, r.algorithm.rollout_correction
    if ro.mode != "async":
        return
    if ro.max_staleness == 0:
        out.append(
            RecipeIssue(
                "rollout.max_staleness",
                "async generates ahead of the trainer, at least one weight version behind; 0 is the synchronous loop",
                value="0",
                fix="set rollout.max_staleness: 1 (or more), or rollout.mode: sync",
            )
        )
    corrected = rc.bypass or rc.weights != "none"
    if ro.max_staleness > 1 and not corrected:
        out.append(
            RecipeIssue(
                "rollout.max_staleness",
                f"samples up to {ro.max_staleness} weight versions old and a loss without an off-policy "
                "correction: the gradient is biased by how far the rollout policy has drifted",
                value=str(ro.max_staleness),
                fix="set algorithm.rollout_correction.weights: token (truncated importance sampling) or "
                "algorithm.rollout_correction.bypass: true, or rollout.max_staleness: 1",
            )
        )
    if getattr(r.algorithm, "dynamic_sampling", False):
        out.append(
            RecipeIssue(
                "algorithm.dynamic_sampling",
                "dynamic sampling refills a step's batch by generating again with the newest weights, "
                "which an async pipeline has already moved past",
                value="true",
                fix="set algorithm.dynamic_sampling: false, or rollout.mode: sync",
            )
        )
    if ro.max_staleness >= r.run.steps:
        out.append(
            RecipeIssue(
                "rollout.max_staleness",
                f"the run has {r.run.steps} steps: a pipeline {ro.max_staleness} steps deep never overlaps",
                value=str(ro.max_staleness),
                fix=f"set rollout.max_staleness below run.steps ({r.run.steps}), or rollout.mode: sync",
            )
        )


def plan_memory(r: Recipe, m: ModelInfo) -> Memory:
    """`rlbridge plan`'s memory estimate per device for `r` (its data-parallel size from the layout)."""
    from rlbridge.plan import batches, memory

    p = r.trainer.parallel
    dp = max(r.world_size // (p.tensor * p.pipeline * p.context), 1)
    return memory(r, m, dp, batches(r, dp))


def check_async_memory(r: Recipe, m: ModelInfo, out: Issues) -> None:
    """async on shared GPUs: vLLM stays resident next to the trainer, so both must fit at once (plan.memory)."""
    c = r.cluster
    if (
        r.rollout.mode != "async"
        or not c.colocate
        or c.device != "cuda"
        or not rollout_engine(r).reserves_memory
    ):
        return
    mem = plan_memory(r, m)
    if mem.trainer_total + mem.rollout_total <= mem.capacity:
        return
    margin = 1.0  # GiB for CUDA contexts and fragmentation
    fits = math.floor((mem.capacity - mem.trainer_total - margin) / mem.capacity * 100) / 100
    need = (mem.rollout_weights + 0.5) / mem.capacity  # the weights and a small KV cache
    fix = (
        f"set rollout.gpu_memory_utilization: {fits} (or lower), or cluster.colocate: false"
        if fits >= need
        else "set cluster.colocate: false (the rollout on devices of its own), or rollout.mode: sync"
    )
    out.append(
        RecipeIssue(
            "rollout.gpu_memory_utilization",
            f"async keeps vLLM resident next to the trainer: the trainer's ~{mem.trainer_total:.1f} GiB and vLLM's "
            f"{r.rollout.gpu_memory_utilization} x {mem.capacity:.0f} GiB = {mem.rollout_total:.1f} GiB exceed "
            f"the {mem.capacity:.0f} GiB per device",
            value=str(r.rollout.gpu_memory_utilization),
            fix=fix,
        )
    )


VLLM_WORKSPACE_GIB = 1.0
"""What a vLLM engine holds on a GPU beyond weights and KV cache (activations of its profiling run, sampler,
CUDA graphs' pool), at least: its share must leave room for that and one sequence's KV cache."""


def least_rollout_share(r: Recipe, m: ModelInfo) -> float:
    """The smallest rollout.gpu_memory_utilization whose share of the device holds one engine's weights, its
    workspace and the KV cache of one sequence of max_prompt_tokens + max_response_tokens; else vLLM stops at
    start with "No available memory for the cache blocks"."""
    from rlbridge.plan import DTYPE_BYTES

    mem = plan_memory(r, m)
    tp, unit = r.rollout.tensor_parallel, DTYPE_BYTES[r.model.dtype]
    tokens = r.rollout.max_prompt_tokens + r.rollout.max_response_tokens
    kv = 2 * m.layers * max(m.kv_heads // tp, 1) * m.head_dim * unit * tokens / 1024**3
    per_engine = mem.rollout_weights + VLLM_WORKSPACE_GIB + kv
    return math.ceil(per_engine / mem.capacity * 100) / 100


def check_rollout_share(r: Recipe, m: ModelInfo, out: Issues) -> None:
    """GPUs, an engine that reserves its share up front (vLLM): rollout.gpu_memory_utilization x the device must
    hold the engine's weights, workspace and one full-length sequence's KV cache."""
    if r.cluster.device != "cuda" or not rollout_engine(r).reserves_memory:
        return
    least = least_rollout_share(r, m)
    if r.rollout.gpu_memory_utilization >= least:
        return
    capacity = r.cluster.gpu_memory_gib
    fix = (
        f"set rollout.gpu_memory_utilization: {least} (or more)"
        if least <= 0.95
        else "raise rollout.tensor_parallel (each engine then holds a part of the weights)"
    )
    out.append(
        RecipeIssue(
            "rollout.gpu_memory_utilization",
            f"{r.rollout.gpu_memory_utilization} x {capacity:.0f} GiB cannot hold the rollout engine's weights, its "
            f"working memory and the KV cache of one {r.rollout.max_prompt_tokens + r.rollout.max_response_tokens}"
            f"-token sequence ({least} of the device at least): vLLM would stop at start",
            value=str(r.rollout.gpu_memory_utilization),
            fix=fix,
        )
    )


def check_device_memory(r: Recipe, m: ModelInfo, out: Issues) -> None:
    """The plan's estimated peak per device (plan.memory, +-30 %) over cluster.gpu_memory_gib is an error: such a
    run dies of out-of-memory after minutes of start-up. The fix lists the single changes whose estimate fits,
    and --force (commands that check recipes) runs it anyway. GPUs only: on a CPU the figure is host memory."""
    if r.cluster.device != "cuda":
        return

    def peak(recipe: Recipe) -> tuple[float, float]:
        mem = plan_memory(recipe, m)
        return mem.peak, mem.capacity

    need, capacity = peak(r)
    if need <= capacity:
        return
    fits = []
    for change, changed in _memory_changes(r, least_rollout_share(r, m), lambda c: peak(c)[0] <= capacity):
        after, _ = peak(changed)
        if after <= capacity:
            fits.append(f"{change} (~{after:.0f} GiB)")
    fix = ("set " + ", or ".join(fits) + "; " if fits else "no single change fits: combine LoRA, more tensor parallel, "
           "recompute and a smaller micro_batch_size; ")  # fmt: skip
    out.append(
        RecipeIssue(
            "cluster.gpu_memory_gib",
            f"the estimated peak of {need:.1f} GiB per device exceeds the {capacity:.0f} GiB a device has "
            "(`rlbridge plan --force` shows its parts: weights, gradients, optimizer state, activations, vLLM, "
            "a reward model on the GPU)",
            fix=fix + "or pass --force to run it anyway (the estimate is within about 30 %)",
        )
    )


def _memory_changes(
    r: Recipe, least_share: float, fits: Callable[[Recipe], bool]
) -> list[tuple[str, Recipe]]:
    """Single recipe changes that lower the memory peak, as (how to write it, the changed recipe); `least_share`:
    the smallest rollout.gpu_memory_utilization the engine can start with (least_rollout_share); `fits`: whether a
    recipe's estimated peak fits the device, for the token budget per pass (the largest multiple of 1024 that fits)."""
    t, ro = r.trainer, r.rollout

    def with_(section: str, **values: object) -> Recipe:
        return r.model_copy(update={section: getattr(r, section).model_copy(update=values)})

    def trainer(**values: object) -> Recipe:
        return r.model_copy(update={"trainer": t.model_copy(update=values)})

    out: list[tuple[str, Recipe]] = []
    if not r.lora.enabled:
        out.append(("lora.rank: 16 (LoRA instead of full fine-tuning)", with_("lora", rank=16)))
    engine = trainer_engine(r)
    if "tensor" in engine.parallel:
        tp = t.parallel.tensor * 2
        if r.world_size % (tp * t.parallel.pipeline * t.parallel.context) == 0:
            out.append(
                (
                    f"trainer.parallel.tensor: {tp}",
                    trainer(parallel=t.parallel.model_copy(update={"tensor": tp})),
                )
            )
        if engine.recompute_block and t.recompute.granularity != "full":
            full = t.recompute.model_copy(
                update={"granularity": "full", "method": "uniform", "num_layers": 1}
            )
            out.append(("trainer.recompute.granularity: full", trainer(recompute=full)))
        if engine.multi_rank and not t.distributed_optimizer and r.world_size > 1:
            out.append(("trainer.distributed_optimizer: true", trainer(distributed_optimizer=True)))
    if t.micro_batch_size > 1 and t.max_tokens_per_micro_batch is None:
        out.append(("trainer.micro_batch_size: 1", trainer(micro_batch_size=1)))
    budget = t.max_tokens_per_micro_batch
    if budget is not None and budget >= 2048:
        smaller = _largest_budget(budget, lambda b: fits(trainer(max_tokens_per_micro_batch=b)))
        if smaller is not None:
            out.append(
                (
                    f"trainer.max_tokens_per_micro_batch: {smaller}",
                    trainer(max_tokens_per_micro_batch=smaller),
                )
            )
    sleeps = rollout_engine(r).reserves_memory
    if r.cluster.colocate and sleeps and (ro.mode == "async" or ro.sleep != "always"):
        out.append(("rollout.sleep: always", with_("rollout", sleep="always")))
    share = max(0.3, math.ceil(least_share * 20) / 20)  # a multiple of 0.05 that still holds the engine
    if r.cluster.colocate and ro.gpu_memory_utilization > share and share <= 0.95:
        out.append(
            (f"rollout.gpu_memory_utilization: {share:g}", with_("rollout", gpu_memory_utilization=share))
        )
    terms = r.reward.terms or []
    for i, term in enumerate(terms):  # a reward model scoring on the GPU (plan.reward_model_gib)
        if term.model is not None and term.device == "cuda":
            cpu = [u.model_copy(update={"device": "cpu"}) if u is term else u for u in terms]
            out.append((f"reward.terms.{i}.device: cpu", with_("reward", terms=cpu)))
    return [(how, changed) for how, changed in out if not unsaved_layouts(changed)]  # never a refused fix


def _largest_budget(refused: int, fits: Callable[[int], bool], step: int = 1024) -> int | None:
    """The largest multiple of `step` below `refused` for which `fits` holds, by bisection (the plan's peak grows
    with the budget); None when not even `step` fits."""
    lo, hi = 0, (refused - 1) // step  # in units of step: lo fits (0: nothing yet), hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step or None
