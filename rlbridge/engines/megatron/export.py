"""Megatron model -> HF-named weights (merged) or a PEFT adapter, through Megatron-Bridge's exporters.

The bridge does the hard part (gathering TP shards, moving tensors across pipeline stages, splitting fused
qkv / gate_up into HF projections, merging LoRA as base + (alpha / dim) * B @ A). This module adds what an
RL trainer needs around it, each one a bug class from USER_REPORTS:

* names: Megatron-Bridge 0.3.x names unmerged base weights `...q_proj.base_layer.weight`; a merged export
  must carry plain HF names, so `.base_layer` is stripped and a collision is an error;
* tied embeddings: a tied model exports `model.embed_tokens.weight` (and `lm_head.weight` only if identical);
  an untied model must export both;
* tensors replicated across pipeline stages: the bridge refuses any tensor found on two PP ranks ("Tensor
  exists on more than one PP rank"), although some models legitimately replicate tensors. The patch below
  accepts duplicates whose specs and values are identical on every owner and fails loudly otherwise;
* experts without Transformer Engine: megatron-core builds a SequentialMLP (`experts.local_experts.<e>.linear_fc1`)
  instead of TE's grouped layers (`experts.linear_fc1.weight<e>`); Megatron-Bridge's `gather_from_ep_ranks` reads
  the expert number only from the grouped spelling (`int(name.split(".weight")[-1])`: ValueError on
  `int("")`), so every MoE export failed. `install_sequential_expert_export` reads it from either spelling;
* adapters: PEFT names (`base_model.model.<hf name>.lora_A.weight`) and an adapter_config that
  `peft.PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlbridge.recipe.schema import Recipe
from rlbridge.recipe.targets import hf_targets
from rlbridge.weights import WeightSync

PEFT_PREFIX = "base_model.model."


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """Detached, and never sharing storage with a live parameter (on CPU the bridge's `.cpu()` is a no-op)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def normalize_merged_names(items: Any, *, tied: bool) -> dict[str, torch.Tensor]:
    """HF names without `.base_layer`; a name produced twice must carry identical values (a tied embedding
    exported from the first and the last pipeline stage); tied models drop an identical lm_head."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        clean = name.replace(".base_layer.", ".")
        if clean in out:
            if not torch.equal(out[clean], tensor.detach().to(out[clean].device)):
                raise ValueError(f"export produced {clean!r} twice with different values (raw name {name!r})")
            continue
        out[clean] = _own(tensor)
    if tied and "lm_head.weight" in out:
        if not torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"]):
            raise ValueError("tied embeddings diverged: lm_head.weight != model.embed_tokens.weight")
        del out["lm_head.weight"]
    if not tied and "model.embed_tokens.weight" in out and "lm_head.weight" not in out:
        raise ValueError("untied model exported no lm_head.weight")
    return out


def peft_adapter_config(recipe: Recipe) -> dict[str, Any]:
    """adapter_config.json content for the recipe's LoRA (PEFT's field names)."""
    lora = recipe.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": recipe.model.path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": hf_targets(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": lora.type == "dora",
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def peft_adapter_names(items: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if ".lora_A." not in name and ".lora_B." not in name:
            raise ValueError(f"unexpected adapter tensor {name!r} (expected lora_A / lora_B)")
        out[PEFT_PREFIX + name] = _own(tensor)
    return out


# ------------------------------------------------------------------ pipeline-replicated tensors
def _broadcast_from_pp_owners(self: Any, tensor: torch.Tensor | None, cache_key: str | None = None) -> Any:
    """Megatron-Bridge's broadcast_from_pp_rank, accepting owners that hold identical copies."""
    if self.pp_size == 1:
        return tensor
    spec = None
    if tensor is not None:
        spec = (
            tuple(tensor.shape),
            tensor.dtype,
            getattr(tensor, "tensor_model_parallel", None),
            getattr(tensor, "partition_dim", None),
        )
    specs: list[Any] = [None] * self.pp_size
    dist.all_gather_object(specs, spec, group=self.pp_group)
    owners = [rank for rank, s in enumerate(specs) if s is not None]
    if not owners:
        raise ValueError("Object must exist on at least one PP rank")
    first = specs[owners[0]]
    if any(specs[r] != first for r in owners[1:]):
        raise ValueError(
            f"tensor {self.megatron_param} exists on PP ranks {owners} with different specs: "
            f"{[specs[r] for r in owners]}"
        )
    if tensor is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        tensor = torch.empty(first[0], dtype=first[1], device=device)
        if first[2] is not None:
            tensor.tensor_model_parallel = first[2]  # type: ignore[attr-defined]  # megatron reads these attributes that it sets on tensors itself
        if first[3] is not None:
            tensor.partition_dim = first[3]  # type: ignore[attr-defined]  # megatron reads these attributes that it sets on tensors itself
    tensor = tensor.contiguous()  # gloo sends a view's raw storage
    mine = tensor.detach().clone() if len(owners) > 1 else None
    src = dist.get_global_rank(self.pp_group, owners[0])
    dist.broadcast(tensor, src=src, group=self.pp_group)
    if len(owners) > 1:
        differs = torch.zeros(1, device=tensor.device)
        if dist.get_rank(self.pp_group) in owners and mine is not None:
            differs[0] = float(not torch.equal(mine, tensor))
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=self.pp_group)
        if differs.item():
            raise ValueError(
                f"tensor {self.megatron_param} is replicated on PP ranks {owners} with different values"
            )
    return tensor


def install_pp_duplicate_check() -> None:
    """Replace MegatronParamMapping.broadcast_from_pp_rank (all Megatron-Bridge versions seen refuse
    duplicates outright). Idempotent."""
    from megatron.bridge.models.conversion import param_mapping

    cls = param_mapping.MegatronParamMapping
    if getattr(cls.broadcast_from_pp_rank, "_rlbridge", False):
        return
    _broadcast_from_pp_owners._rlbridge = True  # type: ignore[attr-defined]  # megatron reads these attributes that it sets on tensors itself
    cls.broadcast_from_pp_rank = _broadcast_from_pp_owners


# ------------------------------------------------------------------ experts of a SequentialMLP
_SEQUENTIAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _experts_per_rank(self: Any, megatron_module: Any) -> int:
    per_rank = None
    if megatron_module is not None:
        per_rank = int(self._get_config(megatron_module).num_moe_experts) // self.ep_size
    try:
        return int(self.broadcast_obj_from_pp_rank(per_rank, "num_experts_per_rank"))
    except TypeError:  # Megatron-Bridge versions without the cache-key argument
        return int(self.broadcast_obj_from_pp_rank(per_rank))


def _global_sequential_expert_names() -> None:
    """Megatron-Bridge 0.3.1's `_megatron_local_name_to_global` turns local expert numbers into global ones only in
    TE's grouped names (`experts.linear_fc1.weight<e>`). A SequentialMLP's `experts.local_experts.<e>` kept its
    local number, so at expert parallel > 1 every rank loaded (and exported under) experts 0..k-1: the model of EP
    rank r > 0 silently held the wrong experts (seen at EP2 on CPU: logits rel. error 0.70 vs transformers). The
    wrapper renumbers `local_experts.<e>` (adapters included: each expert has its own) as the grouped case does."""
    import inspect

    from megatron.bridge.models.conversion import model_bridge

    original = getattr(model_bridge, "_megatron_local_name_to_global", None)
    if original is None or getattr(original, "_rlbridge", False):
        return  # None: a Megatron-Bridge without this helper
    if "local_experts" in inspect.getsource(original):
        return  # a version that renumbers SequentialMLP experts itself

    def local_name_to_global(models: Any, config: Any, param_name: str, vp_stage: Any = None) -> str:
        name = str(original(models, config, param_name, vp_stage))
        m = _SEQUENTIAL_EXPERT.search(name)
        if m is None:
            return name
        from megatron.core import parallel_state as ps

        ep_size = ps.get_expert_model_parallel_world_size()
        if ep_size <= 1:
            return name
        per_rank = int(config.num_moe_experts) // ep_size
        number = per_rank * ps.get_expert_model_parallel_rank() + int(m.group(1))
        return name[: m.start()] + f".local_experts.{number}." + name[m.end() :]

    local_name_to_global._rlbridge = True  # type: ignore[attr-defined]  # marker attribute on our own function
    model_bridge._megatron_local_name_to_global = local_name_to_global


def _merge_sequential_expert_adapters() -> None:
    """At expert parallel > 1 the base weight of a SequentialMLP expert comes back gathered from every EP rank (one
    HF name per rank, in rank order), but Megatron-Bridge 0.3.1 merges this rank's adapter into all of them. The
    wrapper gathers the adapter over the EP group too and merges rank k's adapter into rank k's expert."""
    try:
        from megatron.bridge.models.conversion import peft_bridge
    except ImportError:  # a Megatron-Bridge without the module: nothing to patch
        return

    cls = getattr(peft_bridge, "MegatronPeftBridge", None)
    original = getattr(cls, "_merge_lora_adapter_weights", None)
    if (
        cls is None or original is None or getattr(original, "_rlbridge", False)
    ):  # another Megatron-Bridge layout
        return

    def merge(
        self: Any, megatron_model: Any, converted: dict[str, torch.Tensor], adapter_weights: Any
    ) -> Any:
        from megatron.core import parallel_state as ps

        ep_size = ps.get_expert_model_parallel_world_size()
        sequential = len(adapter_weights) == 1 and ".local_experts." in adapter_weights[0].global_base_prefix
        if not sequential or ep_size <= 1:
            return original(self, megatron_model, converted, adapter_weights)
        import dataclasses

        weight = adapter_weights[0]
        group = ps.get_expert_model_parallel_group()

        def gather(t: torch.Tensor) -> list[torch.Tensor]:
            out = [torch.empty_like(t) for _ in range(ep_size)]
            dist.all_gather(out, t.contiguous(), group=group)
            return out

        ins, outs = gather(weight.linear_in_weight.weight), gather(weight.linear_out_weight.weight)
        per_rank = int(megatron_model[0].config.num_moe_experts) // ep_size
        owner: dict[str, int] = {}
        for n in converted:
            m = re.search(r"experts\.(\d+)\.", n)
            if m is None:
                raise ValueError(f"gathered expert tensor {n!r} names no expert")
            owner[n] = int(m.group(1)) // per_rank  # the EP rank that holds this expert (and its adapter)
        merged: dict[str, torch.Tensor] = {}
        for k in range(ep_size):
            part = {n: t for n, t in converted.items() if owner[n] == k}
            if not part:
                continue
            own = dataclasses.replace(
                weight,
                linear_in_weight=weight.linear_in_weight._replace(weight=ins[k]),
                linear_out_weight=weight.linear_out_weight._replace(weight=outs[k]),
            )
            result = original(self, megatron_model, part, [own])
            merged.update(part if result is None else result)
        return merged

    merge._rlbridge = True  # type: ignore[attr-defined]  # marker attribute on our own function
    cls._merge_lora_adapter_weights = merge  # type: ignore[method-assign]  # patches megatron-bridge's method on purpose


def install_sequential_expert_export() -> None:
    """Make Megatron-Bridge's expert gather understand SequentialMLP names (module docstring), number their
    experts globally at expert parallel > 1 (`_global_sequential_expert_names`) and merge each EP rank's expert
    adapters into its own experts (`_merge_sequential_expert_adapters`). Idempotent."""
    from megatron.bridge.models.conversion import param_mapping

    _global_sequential_expert_names()
    _merge_sequential_expert_adapters()

    cls = param_mapping.MegatronParamMapping
    original = getattr(cls, "gather_from_ep_ranks", None)
    if original is None or getattr(original, "_rlbridge", False):  # None: a Megatron-Bridge without it
        return

    def gather_from_ep_ranks(
        self: Any, megatron_weights: Any, megatron_module: Any, hf_param_name: Any
    ) -> dict[str, torch.Tensor]:
        m = _SEQUENTIAL_EXPERT.search(str(self.megatron_param))
        if m is None:
            return original(self, megatron_weights, megatron_module, hf_param_name)  # type: ignore[no-any-return]  # Megatron-Bridge is untyped
        per_rank = _experts_per_rank(self, megatron_module)
        local = int(m.group(1)) % per_rank
        names = [
            re.sub(r"experts\.(\d+)", f"experts.{local + per_rank * k}", str(hf_param_name))
            for k in range(self.ep_size)
        ]
        if self.ep_size == 1:
            return {names[0]: megatron_weights}
        gathered = [torch.empty_like(megatron_weights) for _ in range(self.ep_size)]
        dist.all_gather(gathered, megatron_weights.contiguous(), group=self.ep_group)
        return dict(zip(names, gathered, strict=True))

    gather_from_ep_ranks._rlbridge = True  # type: ignore[attr-defined]  # marker attribute on our own function
    cls.gather_from_ep_ranks = gather_from_ep_ranks  # type: ignore[method-assign]  # patches megatron-bridge's method on purpose (see the docstring above)


# ------------------------------------------------------------------ a full fine-tuning checkpoint as HF weights
def full_checkpoint_to_hf(recipe: Recipe, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The canonical tensors of a full fine-tuning checkpoint (engines/megatron/state.py: every weight, float32,
    under Megatron names) as HF-named weights in recipe.model.dtype, through the bridge that trained them.

    Megatron names are not HF names (fused qkv and gate/up, Megatron's layer norms, per-architecture mappings), and
    only the bridge knows every architecture's mapping. So this builds the recipe's model once more in this
    process: one rank (a gloo group of one, made here when none exists), tensor / pipeline / expert parallel 1, in
    float32 so that the checkpoint's float32 values load unrounded; loads the tensors into it (`load_state`, which
    names anything missing or extra) and exports the merged weights as the trainer's weight sync does, cast to
    model.dtype at the end (the trainer's 16-bit weights are the same rounding of the same float32 values). Costs
    the model twice in memory (the model and its gradient buffers) plus the exported copy."""
    from rlbridge.engines.megatron import compat
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    p = recipe.trainer.parallel
    one_rank = recipe.model_copy(
        update={
            "model": recipe.model.model_copy(update={"dtype": "float32"}),
            "trainer": recipe.trainer.model_copy(
                update={
                    "parallel": p.model_copy(
                        update={
                            "tensor": 1,
                            "pipeline": 1,
                            "virtual_pipeline": None,
                            "context": 1,
                            "expert": 1,
                            "expert_tensor": 1,
                            "sequence_parallel": False,
                        }
                    ),
                    "distributed_optimizer": False,
                    "recompute": recipe.trainer.recompute.model_copy(
                        update={"granularity": "none", "method": None, "num_layers": None}
                    ),
                }
            ),
            "algorithm": recipe.algorithm.model_copy(
                update={"kl": recipe.algorithm.kl.model_copy(update={"coef": 0.0})}  # no reference copy
            ),
            "cluster": recipe.cluster.model_copy(update={"nodes": 1, "gpus_per_node": 1}),
        }
    )
    compat.activate()
    with _process_group():
        engine = MegatronTrainEngine(one_rank)
        try:
            from rlbridge.engines.megatron import state

            with compat.device_scope():
                state.load_state(engine.model, engine.optimizer, tensors, {}, "the checkpoint")
            merged = engine.export_weights(WeightSync.MERGED).tensors
        finally:
            engine.close()
    dtype = getattr(torch, recipe.model.dtype)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()}


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """A torch.distributed group of this one process (gloo; NCCL on a GPU), unless one exists already."""
    if dist.is_initialized():
        yield
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
