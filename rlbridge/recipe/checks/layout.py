"""The cluster layout (trainer parallelism and the rollout's engines on the devices) and the batch sizes."""

from __future__ import annotations

import math
from collections.abc import Callable

from rlbridge.engines.registry import trainer_engine, trainer_engines_that
from rlbridge.engines.spec import TrainerEngineSpec
from rlbridge.errors import RecipeIssue
from rlbridge.recipe.checks.common import Issues, choices, divisors
from rlbridge.recipe.schema import GROUP_ALGORITHMS, Recipe
from rlbridge.rollout.registry import rollout_engine


# -------------------------------------------------------------------------------- cluster layout
def check_layout(r: Recipe, out: Issues) -> None:
    p = r.trainer.parallel
    world = r.world_size
    model_parallel = p.tensor * p.pipeline * p.context
    spec = trainer_engine(r)
    if not spec.multi_rank:
        for key, value in (
            ("tensor", p.tensor),
            ("pipeline", p.pipeline),
            ("context", p.context),
            ("expert", p.expert),
            ("expert_tensor", p.expert_tensor),
        ):
            if value != 1 and key not in spec.parallel:
                out.append(
                    RecipeIssue(
                        f"trainer.parallel.{key}",
                        f"the {spec.name} engine has no {key} parallelism",
                        value=str(value),
                        fix=f"set trainer.parallel.{key}: 1 or trainer.engine: "
                        + trainer_engines_that(lambda e: key in e.parallel),  # noqa: B023  # called here
                    )
                )
        if world != 1:
            out.append(
                RecipeIssue(
                    "cluster.gpus_per_node",
                    f"the {spec.name} engine trains in one process, but the cluster has {world} devices",
                    value=str(world),
                    fix="set cluster.nodes: 1 and cluster.gpus_per_node: 1, or use trainer.engine: "
                    + trainer_engines_that(lambda e: e.multi_rank),
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
                fix=f"make tensor x pipeline x context divide {world} (e.g. tensor x pipeline x context in {choices(ok)})",
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
                fix=f"set trainer.parallel.expert to one of {choices([d for d in divisors(dp * p.context * p.tensor // p.expert_tensor)])}",
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
    gpus = r.rollout_devices
    if gpus % r.rollout.tensor_parallel:
        out.append(
            RecipeIssue(
                "rollout.tensor_parallel",
                f"rollout tensor_parallel {r.rollout.tensor_parallel} does not divide the {gpus} rollout devices",
                fix=f"set rollout.tensor_parallel to {choices(divisors(gpus))}",
            )
        )
    k = r.rollout.engines_per_device
    if k > 1 and r.rollout.tensor_parallel > 1:
        out.append(
            RecipeIssue(
                "rollout.engines_per_device",
                f"{k} engines per device need rollout.tensor_parallel 1 (an engine of several devices shares none)",
                value=str(k),
                fix="set rollout.engines_per_device: 1, or rollout.tensor_parallel: 1",
            )
        )
    elif (
        k > 1
        and r.cluster.device == "cuda"
        and rollout_engine(r).reserves_memory
        and k * r.rollout.gpu_memory_utilization > 1
    ):
        each = math.floor(0.9 / k * 100) / 100
        out.append(
            RecipeIssue(
                "rollout.gpu_memory_utilization",
                f"{k} engines per device each take rollout.gpu_memory_utilization {r.rollout.gpu_memory_utilization}"
                f" of it: {k * r.rollout.gpu_memory_utilization:.2f} of the device",
                value=str(r.rollout.gpu_memory_utilization),
                fix=f"set rollout.gpu_memory_utilization: {each} (or lower), or rollout.engines_per_device: 1",
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
    greedy = r.rollout.temperature == 0 or r.rollout.top_k == 1
    if r.algorithm.name in GROUP_ALGORITHMS and greedy:
        key, value = ("rollout.temperature", "0") if r.rollout.temperature == 0 else ("rollout.top_k", "1")
        out.append(
            RecipeIssue(
                key,
                f"greedy sampling gives every completion of a prompt the same text and reward, so {r.algorithm.name}'s "
                "group-relative advantages are all zero and no step learns anything",
                value=value,
                fix="set rollout.temperature: 1.0"
                if key == "rollout.temperature"
                else "set rollout.top_k: -1",
            )
        )
    mini = r.mini_batch_size
    if d.batch_size % mini:
        out.append(
            RecipeIssue(
                "data.mini_batch_size",
                f"mini_batch_size {mini} does not divide batch_size {d.batch_size}",
                fix=f"set data.mini_batch_size to {choices(divisors(d.batch_size))}",
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
                fix=f"set trainer.micro_batch_size to {choices(divisors(per_rank))}",
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
    if r.trainer.max_tokens_per_micro_batch is None or not trainer_engine(r).budget_flat_only:
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


def check_shared_prompts(r: Recipe, out: Issues) -> None:
    """trainer.shared_prompts always asks for the hf engine's shared passes, which in padded passes need the model's
    KV cache in the training forward (no recompute; packed passes share prompts without it); auto and off never
    fail."""
    if r.trainer.shared_prompts != "always":
        return
    if not trainer_engine(r).shared_prompts:
        out.append(
            RecipeIssue(
                "trainer.shared_prompts",
                f"always: the {r.trainer.engine} engine has no shared-prompt passes "
                f"(the {trainer_engines_that(lambda e: e.shared_prompts)} engine has)",
                value="always",
                fix="set trainer.shared_prompts to auto or never, or trainer.engine to "
                + trainer_engines_that(lambda e: e.shared_prompts),
            )
        )
    elif r.trainer.recompute.granularity != "none" and not r.trainer.packed_passes:
        out.append(
            RecipeIssue(
                "trainer.shared_prompts",
                f"always: shared prompts need the KV cache of every layer, which recompute "
                f"({r.trainer.recompute.granularity}) drops",
                value="always",
                fix="set trainer.shared_prompts to auto or never, trainer.recompute.granularity to none, or "
                "trainer.packed_passes to true",
            )
        )


def check_packed_passes(r: Recipe, out: Issues) -> None:
    """trainer.packed_passes: the hf engine's packed rows (engines/hf/varlen.py); what their layout cannot carry is
    refused here. Sliding-window models: recipe/checks/model.py (check_packed_passes_model, from the config)."""
    if not r.trainer.packed_passes:
        return
    reasons = _engine_reasons(r, lambda e: e.packed_passes, "packed passes")
    if r.trainer.cuda_graphs:
        reasons.append(("CUDA graphs record padded pass shapes", "trainer.cuda_graphs: false"))
    if r.rollout.routing_replay:
        reasons.append(("routing replay sets experts per padded column", "rollout.routing_replay: false"))
    _refuse_flag(out, "trainer.packed_passes", reasons)


def check_cuda_graphs(r: Recipe, out: Issues) -> None:
    """trainer.cuda_graphs records the hf engine's passes on a GPU (engines/hf/graphs.py): what it cannot record is
    refused here, not discovered at the first step."""
    if not r.trainer.cuda_graphs:
        return
    reasons = _engine_reasons(r, lambda e: e.cuda_graphs, "recorded passes")
    if r.cluster.device != "cuda":
        reasons.append(
            (f"CUDA graphs need cluster.device cuda, not {r.cluster.device}", "cluster.device: cuda")
        )
    if r.trainer.recompute.granularity != "none":
        reasons.append(
            (
                f"recompute ({r.trainer.recompute.granularity}) is not recorded",
                "trainer.recompute.granularity: none",
            )
        )
    if r.rollout.routing_replay:
        reasons.append(
            ("routing replay sets each pass's experts from the host", "rollout.routing_replay: false")
        )
    if not r.lora.enabled and r.model.dtype != "float32":
        reasons.append(
            (
                f"full fine-tuning of a {r.model.dtype} model moves gradients into float32 masters by hooks, "
                "which a replayed backward does not run",
                "LoRA (lora.rank > 0) or model.dtype: float32",
            )
        )
    if r.lora.enabled and r.lora.compute_dtype == "model" and r.model.dtype != "float32":
        reasons.append(
            (
                f"lora.compute_dtype model keeps {r.model.dtype} adapters whose gradients move into float32 "
                "masters by hooks, which a replayed backward does not run",
                "lora.compute_dtype: float32",
            )
        )
    _refuse_flag(out, "trainer.cuda_graphs", reasons)


def _engine_reasons(r: Recipe, has: Callable[[TrainerEngineSpec], bool], what: str) -> list[tuple[str, str]]:
    """[(why, fix)] of a boolean trainer option the recipe's engine lacks (`what` it has not), else []."""
    if has(trainer_engine(r)):
        return []
    others = trainer_engines_that(has)
    return [
        (
            f"the {r.trainer.engine} engine has no {what} (the {others} engine has)",
            f"trainer.engine: {others}",
        )
    ]


def _refuse_flag(out: Issues, key: str, reasons: list[tuple[str, str]]) -> None:
    """One issue per (why, fix) against boolean option `key` set true: its fix, or the option off."""
    for why, fix in reasons:
        out.append(RecipeIssue(key, why, value="true", fix=f"set {fix}, or {key}: false"))
