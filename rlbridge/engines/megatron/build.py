"""Build the Megatron model for one rank: parallel state, seeds, PEFT before the wrap, DDP, optimizer.

Two loaders produce the same `Model` bundle:

* Megatron-Bridge (`trainer.bridge: megatron-bridge`): the table-configured provider
  (provider.py) builds the model through `provide_distributed_model`; PEFT is a pre-wrap hook, registered
  after the bridge's weight-loading hook and before the DDP wrap, so the grad buffers and the optimizer only
  ever see the adapters. Megatron-Bridge >= 0.3.0 applies the recompute-input fix inside `PEFT.__call__`;
  `ensure_recompute_input_fix` verifies it and applies the same fix where a version does not.
* mbridge (`trainer.bridge: mbridge`, full fine-tuning only): the same provider values (one source of
  truth) are passed to mbridge's TransformerConfig and checked back; without TE its layer spec is replaced
  by megatron-core's local spec and its name map learns the local spec's separate layer norms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlbridge.engines.megatron import compat
from rlbridge.engines.megatron.params import named_parameters
from rlbridge.engines.megatron.provider import TABLE, Built, local_layer_spec
from rlbridge.errors import RlbridgeError
from rlbridge.model.info import resolve_model_path
from rlbridge.recipe.schema import Recipe

Hook = Callable[[list[torch.nn.Module]], list[torch.nn.Module]]
Exporter = Callable[[list[torch.nn.Module]], Iterable[tuple[str, torch.Tensor]]]
PARALLEL_ATTRS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


@dataclass
class Model:
    chunks: list[torch.nn.Module]
    """One module per virtual pipeline stage, each wrapped in megatron-core's DDP."""
    at_wrap: set[str]
    """Names of the parameters that required grad when the DDP wrap happened."""
    export_merged: Exporter
    export_adapter: Exporter | None
    tied: bool
    vocab_size: int


# ------------------------------------------------------------------------------------ parallel state
def check_backend(recipe: Recipe) -> None:
    """Settings this process cannot run, as errors naming the key (before anything is built)."""
    par, problems = recipe.trainer.parallel, []
    if par.context > 1 and not compat.have_transformer_engine():
        problems.append("trainer.parallel.context > 1 needs Transformer Engine's attention (not installed)")
    if compat.cpu_mode() and recipe.trainer.distributed_optimizer:
        problems.append(
            "trainer.distributed_optimizer needs reduce-scatter, which gloo (CPU) lacks: set it false"
        )
    if compat.cpu_mode() and par.sequence_parallel:
        problems.append("trainer.parallel.sequence_parallel needs reduce-scatter, which gloo (CPU) lacks")
    if recipe.trainer.bridge == "mbridge" and recipe.lora.enabled:
        problems.append(
            "trainer.bridge=mbridge supports full fine-tuning only: set lora.rank 0 or use megatron-bridge"
        )
    if problems:
        raise RlbridgeError("; ".join(problems))


def init_parallel(provider: Any, seed: int) -> bool:
    """Megatron parallel state from the provider's (table-set) sizes. Returns True if this call created it."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RlbridgeError(
            "the megatron engine needs torch.distributed initialized by the caller (gloo on CPU)"
        )
    sizes = {name: getattr(provider, name) for name in PARALLEL_ATTRS}
    created = False
    if ps.model_parallel_is_initialized():
        have = {
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "context_parallel_size": ps.get_context_parallel_world_size(),
        }
        wrong = {k: (v, sizes[k]) for k, v in have.items() if v != sizes[k]}
        if wrong:
            raise RlbridgeError(
                f"megatron parallel state already initialized with other sizes (have, want): {wrong}"
            )
    else:
        ps.initialize_model_parallel(**sizes)
        created = True
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return created


# ------------------------------------------------------------------------------------ megatron-bridge
def ensure_recompute_input_fix(chunks: list[torch.nn.Module], *, outside: tuple[str, ...] = ()) -> bool:
    """Under full recompute with a frozen base, the decoder input must require grad or the adapters inside
    checkpointed layers get no gradient (PP=1). Returns True when the fix is in force (or not needed).
    `outside`: name prefixes of trainable tensors after the decoder (the critic's value head)."""
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.utils import unwrap_model

    needed = []
    for chunk in unwrap_model(chunks):
        if getattr(chunk.config, "recompute_method", None) is None:
            continue
        names_trainable = [
            n for n, p in chunk.named_parameters() if p.requires_grad and not n.startswith(outside)
        ]
        if not names_trainable or not all(".adapter." in n for n in names_trainable):
            continue
        needed.append(chunk)
    for chunk in needed:
        for module in chunk.modules():
            if isinstance(module, TransformerBlock) and not _input_requires_grad(module):
                _patch_block_input(module)
    return all(
        _input_requires_grad(m) for c in needed for m in c.modules() if isinstance(m, TransformerBlock)
    )


def _input_requires_grad(block: torch.nn.Module) -> bool:
    # Megatron-Bridge's fix (peft/recompute.py) wraps TransformerBlock.forward in an instance attribute.
    forward = block.__dict__.get("forward")
    return forward is not None and getattr(forward, "__wrapped__", None) is not None


def _patch_block_input(block: torch.nn.Module) -> None:
    import functools

    original = block.forward

    @functools.wraps(original)
    def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            torch.is_tensor(hidden_states)
            and hidden_states.is_floating_point()
            and not hidden_states.requires_grad
        ):
            hidden_states = hidden_states.detach().requires_grad_(True)
        return original(hidden_states, *args, **kwargs)

    block.forward = forward  # type: ignore[method-assign]  # patches one block's forward on purpose (see the docstring above)


def build_megatron_bridge(built: Built, *, after_peft: Hook | None = None) -> Model:
    """`after_peft`: a pre-wrap hook run after PEFT (and after the weights are loaded), before the DDP wrap
    (the critic replaces the output layer by its value head there)."""
    provider = built.provider
    at_wrap: set[str] = set()
    if built.peft is not None:
        provider.register_pre_wrap_hook(lambda chunks: built.peft(chunks, training=True))
    if after_peft is not None:
        provider.register_pre_wrap_hook(after_peft)

    def record(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        at_wrap.update(n for n, p in named_parameters(chunks) if p.requires_grad)
        return chunks

    provider.register_pre_wrap_hook(record)
    provider.finalize()
    chunks = provider.provide_distributed_model(
        ddp_config=built.ddp,
        wrap_with_ddp=True,
        use_cpu_initialization=compat.cpu_mode(),
        fp16=provider.fp16,
        bf16=provider.bf16,
    )
    restore_tensor_parallel_attributes(chunks)
    bridge = built.bridge
    adapter = None
    if built.peft is not None:
        adapter = lambda model: bridge.export_adapter_weights(model, cpu=True, show_progress=False)  # noqa: E731
    return Model(
        chunks=chunks,
        at_wrap=at_wrap,
        export_merged=lambda model: bridge.export_hf_weights(model, cpu=True, show_progress=False),
        export_adapter=adapter,
        tied=bool(provider.share_embeddings_and_output_weights),
        vocab_size=int(provider.vocab_size),
    )


def restore_tensor_parallel_attributes(chunks: list[torch.nn.Module]) -> int:
    """Mark the weights of megatron-core's tensor-parallel layers as sharded (`tensor_model_parallel`,
    `partition_dim`) where the build left them unmarked; returns how many it marked.

    megatron-core sets these attributes only inside the weight initialization, which Megatron-Bridge skips when it
    loads the HF weights itself (`perform_initialization = False`, and its provider then sets the defaults,
    `tensor_model_parallel = False`): the embedding's, the output layer's and every column- and row-parallel
    linear's weights came out marked unsharded (adapters, built with initialization, and the column-parallel
    biases, marked unconditionally, did not). What reads them then went wrong at tensor parallel > 1
    under full fine-tuning: the layout-free checkpoint (state.py) saved tensor rank 0's shards as if they were the
    full tensors, and megatron-core's gradient-norm clipping counted the shards of tensor rank 0 only. Expert
    layers (sharded over the expert tensor-parallel group, not this one) are left as they are."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    marked = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
                dim = 0
            elif isinstance(module, RowParallelLinear):
                dim = 1
            else:
                continue
            weight = getattr(module, "weight", None)
            if (
                not isinstance(weight, torch.nn.Parameter)
                or getattr(module, "is_expert", False)
                or getattr(weight, "tensor_model_parallel", False)
            ):
                continue
            weight.tensor_model_parallel = True  # type: ignore[attr-defined]  # megatron-core's own attributes
            weight.partition_dim = dim  # type: ignore[attr-defined]  # (set_tensor_model_parallel_attributes
            weight.partition_stride = 1  # type: ignore[attr-defined]  # refuses to overwrite the defaults)
            marked += 1
    return marked


# ------------------------------------------------------------------------------------------- mbridge
def _mbridge_settings(built: Built) -> dict[str, Any]:
    """TransformerConfig values for mbridge, from the same table-configured provider."""
    from rlbridge.engines.megatron.provider import FUSIONS_OFF

    names = [r.target.split(".", 1)[1] for r in TABLE if r.target.startswith("provider.")]
    settings = {n: getattr(built.provider, n) for n in names if n != "hf_model_id"}
    settings["variable_seq_lengths"] = False  # mbridge's default; forward.py keeps micro-batch shapes equal
    if not compat.have_transformer_engine():
        settings.update({name: False for name in FUSIONS_OFF if name != "cross_entropy_loss_fusion"})
    if compat.cpu_mode():
        settings["use_cpu_initialization"] = True
    return settings


def build_mbridge(built: Built, recipe: Recipe) -> Model:
    if compat.versions()["mbridge"] is None:
        raise RlbridgeError(
            "trainer.bridge=mbridge needs mbridge: pip install mbridge==0.15.1, "
            "or set trainer.bridge: megatron-bridge"
        )
    from mbridge import AutoBridge as MBridge

    compat.mbridge_model_type()  # megatron-core >= 0.17 removed a name mbridge 0.15 reads (compat.py)

    path = str(resolve_model_path(recipe.model.path, recipe.model.revision))
    bridge = MBridge.from_pretrained(path)
    rope = getattr(bridge.hf_config, "rope_parameters", None) or {}
    if not hasattr(bridge.hf_config, "rope_theta") and "rope_theta" in rope:
        bridge.hf_config.rope_theta = rope["rope_theta"]  # transformers 5 moved it; mbridge 0.15 reads it
    settings = _mbridge_settings(built)
    bridge.dtype = settings["params_dtype"]
    bridge.set_extra_args(**settings)
    dropped = {
        k: (v, getattr(bridge.config, k, None))
        for k, v in settings.items()
        if getattr(bridge.config, k, None) != v
    }
    if dropped:
        raise RlbridgeError(f"mbridge dropped configuration values (wanted, got): {dropped}")
    tied = bool(getattr(bridge.hf_config, "tie_word_embeddings", False))
    if tied:  # mbridge 0.15's Llama bridge maps a last-stage output layer to lm_head even when tied
        bridge._DIRECT_MAPPING = {
            **bridge._DIRECT_MAPPING,
            "output_layer.weight": "model.embed_tokens.weight",
        }
    if not compat.have_transformer_engine():
        bridge._get_transformer_layer_spec = lambda vp_stage=None: local_layer_spec(bridge.config)
        bridge._OTHER_MAPPING = {
            **bridge._OTHER_MAPPING,
            "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
        }
        bridge._MLP_MAPPING = {
            **bridge._MLP_MAPPING,
            "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        }
    chunks = bridge.get_model(
        wrap_with_ddp=True,
        ddp_config=asdict(built.ddp),
        use_cpu_initialization=compat.cpu_mode(),
        bf16=bool(settings["bf16"]),
        fp16=bool(settings["fp16"]),
    )
    restore_tensor_parallel_attributes(chunks)
    at_wrap = {n for n, p in named_parameters(chunks) if p.requires_grad}
    bridge.load_weights(chunks, path)
    return Model(
        chunks=chunks,
        at_wrap=at_wrap,
        export_merged=lambda model: bridge.export_weights(model),
        export_adapter=None,
        tied=tied,
        vocab_size=int(bridge.hf_config.vocab_size),
    )


# ------------------------------------------------------------------------------------------ optimizer
def build_optimizer(built: Built, chunks: list[torch.nn.Module]) -> Any:
    """megatron-core's optimizer (Adam(W), clipping, mixed precision) wired into the schedule's config."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config

    optimizer = get_megatron_optimizer(built.optim, chunks)
    config = get_model_config(chunks[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return optimizer
