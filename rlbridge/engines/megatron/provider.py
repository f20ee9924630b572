"""Recipe -> Megatron-Bridge provider, DDP config, optimizer config and PEFT, through ONE mapping table.

The bug class this module exists to prevent (USER_REPORTS A, R1): a recipe field that never reaches the
provider or the DDP config, and nothing reports it (parallel sizes not passed to the bridge, recompute
flags dropped, an fp32 grad-reduce flag lost, use_distributed_optimizer re-derived locally). Every
construction-relevant recipe field is therefore one row of `TABLE`: (recipe dotted key, target attribute,
converter). A field that sets nothing is listed in `NOT_IN_TABLE` with the reason. A unit test walks the
schema and fails on a field that is in neither; another builds providers from non-default recipes and
checks `target.attr == converter(recipe value)` for every row.

Targets: `provider` (the GPTModelProvider), `ddp` (DistributedDataParallelConfig), `optim`
(megatron-core OptimizerConfig), `peft` (the PEFT constructor arguments) and `run` (settings the engine
itself reads). Without Transformer Engine the provider also gets the local
layer spec and every fusion off (`BACKEND_NO_TE`): those are not recipe fields but facts of the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlbridge.errors import RlbridgeError
from rlbridge.model.info import resolve_model_path
from rlbridge.recipe.schema import Recipe
from rlbridge.recipe.targets import megatron_targets

Converter = Callable[[Any, Recipe], Any]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
PEFT_CLASSES: dict[str, str] = {"lora": "LoRA", "dora": "DoRA", "canonical_lora": "CanonicalLoRA"}


def _same(value: Any, recipe: Recipe) -> Any:
    return value


def _dtype(value: str, recipe: Recipe) -> torch.dtype:
    return TORCH_DTYPES[value]


def _is(name: str) -> Converter:
    return lambda value, recipe: value == name


def _recompute_granularity(value: str, recipe: Recipe) -> str | None:
    return None if value == "none" else value


def _clip(value: float | None, recipe: Recipe) -> float:
    return 0.0 if value is None else float(value)  # megatron-core: clip_grad 0 means no clipping


def _path(value: str, recipe: Recipe) -> str:
    return str(resolve_model_path(value, recipe.model.revision))


def _lora_targets(value: list[str], recipe: Recipe) -> list[str]:
    return megatron_targets(value, recipe.lora.type)


@dataclass(frozen=True)
class Row:
    key: str
    """Dotted recipe key, e.g. trainer.parallel.tensor."""
    target: str
    """`<object>.<attribute>` it sets: provider., ddp., optim., peft. or run."""
    convert: Converter = _same


TABLE: tuple[Row, ...] = (
    Row("model.path", "provider.hf_model_id", _path),
    Row("trainer.parallel.tensor", "provider.tensor_model_parallel_size"),
    Row("trainer.parallel.pipeline", "provider.pipeline_model_parallel_size"),
    Row("trainer.parallel.virtual_pipeline", "provider.virtual_pipeline_model_parallel_size"),
    Row("trainer.parallel.context", "provider.context_parallel_size"),
    Row("trainer.parallel.expert", "provider.expert_model_parallel_size"),
    Row("trainer.parallel.expert_tensor", "provider.expert_tensor_parallel_size"),
    Row("trainer.parallel.sequence_parallel", "provider.sequence_parallel"),
    Row("trainer.recompute.granularity", "provider.recompute_granularity", _recompute_granularity),
    Row("trainer.recompute.method", "provider.recompute_method"),
    Row("trainer.recompute.num_layers", "provider.recompute_num_layers"),
    Row("model.dtype", "provider.params_dtype", _dtype),
    Row("model.dtype", "provider.pipeline_dtype", _dtype),
    Row("model.dtype", "provider.bf16", _is("bfloat16")),
    Row("model.dtype", "provider.fp16", _is("float16")),
    Row("model.dtype", "optim.params_dtype", _dtype),
    Row("model.dtype", "optim.bf16", _is("bfloat16")),
    Row("model.dtype", "optim.fp16", _is("float16")),
    Row("trainer.distributed_optimizer", "ddp.use_distributed_optimizer"),
    Row("trainer.distributed_optimizer", "optim.use_distributed_optimizer"),
    Row("trainer.grad_reduce_dtype", "ddp.grad_reduce_in_fp32", _is("float32")),
    Row("trainer.micro_batch_size", "run.micro_batch_size"),
    Row("trainer.logprob_chunk_size", "run.logprob_chunk_size"),
    Row("trainer.optim.lr", "optim.lr"),
    Row("trainer.optim.weight_decay", "optim.weight_decay"),
    Row("trainer.optim.betas", "optim.adam_beta1", lambda v, r: v[0]),
    Row("trainer.optim.betas", "optim.adam_beta2", lambda v, r: v[1]),
    Row("trainer.optim.eps", "optim.adam_eps"),
    Row("trainer.optim.clip_grad", "optim.clip_grad", _clip),
    Row("lora.rank", "peft.dim"),
    Row("lora.alpha", "peft.alpha"),
    Row("lora.dropout", "peft.dropout"),
    Row("lora.targets", "peft.target_modules", _lora_targets),
)

NOT_IN_TABLE: dict[str, str] = {
    "model.revision": "picks the Hub snapshot that model.path resolves to (the model.path row's converter)",
    "trainer.engine": "selects this engine (megatron) or the hf engine; nothing to set on a provider",
    "trainer.bridge": "selects the loader (AutoBridge or mbridge) that builds the provider",
    "trainer.ppo_epochs": "loop-level: how often each step's rollouts are passed over",
    "trainer.max_tokens_per_micro_batch": "forms the engine's training passes (forward.split_micro_batches); "
    "refused with pipeline or context parallelism",
    "trainer.pass_width_multiple": "pads each pass's sequence (forward.split_micro_batches seq_multiple)",
    "trainer.packed_passes": "the hf engine's packed rows (engines/hf/varlen.py); refused with this engine by "
    "validate-recipe",
    "trainer.cuda_graphs": "the hf engine's recorded passes (engines/hf/graphs.py); refused with this engine by "
    "validate-recipe",
    "trainer.shared_prompts": "the hf engine's shared-prompt passes; the megatron engine runs plain passes "
    "(always is refused with this engine by validate-recipe)",
    "lora.type": "selects the PEFT class (PEFT_CLASSES) instead of setting a field; tested separately",
    "lora.compute_dtype": "the hf engine's choice: megatron's adapters are always the model's dtype, float32 main params",
    "trainer.optim.min_lr": "read at every step by lr_at, the schedule shared with the hf engine",
    "trainer.optim.schedule": "read at every step by lr_at, the schedule shared with the hf engine",
    "trainer.optim.warmup_steps": "read at every step by lr_at, the schedule shared with the hf engine",
}

# Without Transformer Engine: megatron-core's own modules, and no fused kernels (they need TE or apex).
FUSIONS_OFF: tuple[str, ...] = (
    "gradient_accumulation_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "cross_entropy_loss_fusion",
)
# MoE without Transformer Engine: permutation and router fusions are TE kernels, and a grouped GEMM under the
# local spec would build megatron-core's legacy GroupedMLP (`experts.weight1`), which no bridge maps: the
# experts become a SequentialMLP of per-expert linear layers (`experts.local_experts.<e>.linear_fc1`).
MOE_WITHOUT_TE: tuple[str, ...] = ("moe_permute_fusion", "moe_router_fusion", "moe_grouped_gemm")


@dataclass
class RunSettings:
    """Recipe values the engine reads itself (not megatron configuration)."""

    micro_batch_size: int = 1
    logprob_chunk_size: int | None = None
    """None: the training passes' groups (engines/micro.py scoring_passes)."""


@dataclass
class PeftSettings:
    """Constructor arguments of the Megatron-Bridge PEFT class."""

    dim: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)


@dataclass
class Built:
    """Everything the table configures, for one rank."""

    bridge: Any
    provider: Any
    ddp: Any
    optim: Any
    peft_settings: PeftSettings
    run: RunSettings
    peft: Any = None
    """The PEFT object (None for full fine-tuning)."""

    def target(self, name: str) -> Any:
        return {
            "provider": self.provider,
            "ddp": self.ddp,
            "optim": self.optim,
            "peft": self.peft_settings,
            "run": self.run,
        }[name]


def recipe_value(recipe: Recipe, key: str) -> Any:
    value: Any = recipe
    for part in key.split("."):
        value = getattr(value, part)
    return value


def apply_table(built: Built, recipe: Recipe) -> None:
    for row in TABLE:
        obj_name, attr = row.target.split(".", 1)
        obj = built.target(obj_name)
        if not hasattr(obj, attr):
            raise AttributeError(f"mapping table row {row.key} -> {row.target}: no such attribute")
        setattr(obj, attr, row.convert(recipe_value(recipe, row.key), recipe))


def local_layer_spec(config: Any) -> Any:
    """megatron-core's local (non-TE) layer spec, following the provider's architecture flags, with the core
    attention on torch SDPA (`attention.SDPAttention`) where it applies; `RLBRIDGE_MEGATRON_ATTENTION=unfused`
    keeps megatron's DotProductAttention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rlbridge.engines.megatron.attention import core_attention_class

    spec = get_gpt_layer_local_spec(
        num_experts=getattr(config, "num_moe_experts", None),
        moe_grouped_gemm=getattr(config, "moe_grouped_gemm", False),
        qk_layernorm=getattr(config, "qk_layernorm", False),
        normalization=getattr(config, "normalization", None),
    )
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    sub = getattr(attention, "submodules", None)
    if sub is not None and hasattr(sub, "core_attention"):
        sub.core_attention = core_attention_class(config)
    return spec


def apply_backend(provider: Any) -> None:
    """Local layer spec and fusions off without Transformer Engine; CPU initialization on CPU."""
    from rlbridge.engines.megatron import compat

    if not compat.have_transformer_engine():
        provider.transformer_layer_spec = local_layer_spec
        for name in (*FUSIONS_OFF, *MOE_WITHOUT_TE):
            if hasattr(provider, name):
                setattr(provider, name, False)
    if compat.cpu_mode():
        provider.use_cpu_initialization = True


def make_peft(recipe: Recipe, settings: PeftSettings) -> Any:
    """The Megatron-Bridge PEFT object for the recipe's lora section (None when lora.rank is 0)."""
    if not recipe.lora.enabled:
        return None
    import megatron.bridge.peft.canonical_lora as canonical
    import megatron.bridge.peft.dora as dora
    import megatron.bridge.peft.lora as lora

    classes = {"LoRA": lora.LoRA, "DoRA": dora.DoRA, "CanonicalLoRA": canonical.CanonicalLoRA}
    cls = classes[PEFT_CLASSES[recipe.lora.type]]
    return cls(
        target_modules=list(settings.target_modules),
        dim=settings.dim,
        alpha=settings.alpha,
        dropout=settings.dropout,
    )


def restore_rope_fields(config: Any) -> float | None:
    """transformers 5 moved `rope_theta` (and `rope_scaling`) into `config.rope_parameters`; Megatron-Bridge
    0.3 still reads the old attributes and, finding none, silently builds RoPE with base 10000 (Qwen2.5 uses
    1e6: every log-prob past the first few positions is off). Put them back where the bridge reads them.
    Returns the model's rope_theta (None if it has none)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if getattr(config, "rope_theta", None) is None and "rope_theta" in params:
            config.rope_theta = params["rope_theta"]
        if getattr(config, "rope_scaling", None) is None and params.get("rope_type", "default") != "default":
            config.rope_scaling = dict(params)
    theta = getattr(config, "rope_theta", None)
    return None if theta is None else float(theta)


def build(recipe: Recipe) -> Built:
    """Bridge + configured provider + DDP/optimizer configs + PEFT. Not finalized, no model built yet."""
    from rlbridge.engines.megatron import compat

    compat.activate()
    from megatron.bridge import AutoBridge
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    path = str(resolve_model_path(recipe.model.path, recipe.model.revision))
    bridge = AutoBridge.from_hf_pretrained(path, torch_dtype=TORCH_DTYPES[recipe.model.dtype])
    theta = restore_rope_fields(bridge.hf_pretrained.config)
    provider = bridge.to_megatron_provider(load_weights=True)
    if theta is not None and float(provider.rotary_base) != theta:
        raise RlbridgeError(
            f"Megatron-Bridge set rotary_base {provider.rotary_base} but the model's rope_theta is {theta}: "
            "the trainer would compute different log-probs than the model (report this with the versions "
            f"{compat.versions()})"
        )
    built = Built(
        bridge=bridge,
        provider=provider,
        ddp=DistributedDataParallelConfig(),
        optim=OptimizerConfig(optimizer="adam"),
        peft_settings=PeftSettings(),
        run=RunSettings(),
    )
    apply_table(built, recipe)
    apply_backend(provider)
    # MoE: the trainer optimizes the RL objective only, as the hf engine does (transformers adds no router loss
    # unless output_router_logits). Megatron-Bridge's Qwen3-MoE provider sets a load-balancing loss (1e-3) whose
    # gradient, with the router frozen under LoRA, would reach the adapters through the hidden states.
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(provider, name, None):
            setattr(provider, name, 0.0 if name == "moe_aux_loss_coeff" else None)
    if recipe.rollout.routing_replay:  # each router gets a RouterReplay (engines/megatron/forward.py sets it)
        provider.moe_enable_routing_replay = True
    built.peft = make_peft(recipe, built.peft_settings)
    return built
