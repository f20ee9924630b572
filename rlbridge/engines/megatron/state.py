"""Layout-portable checkpoint state of a megatron model: full tensors under canonical names.

A megatron rank holds shards: its tensor-parallel slice of each trainable tensor, the layers of its pipeline
stage (numbered from 0 on every stage), a `chunk<i>.` prefix per virtual stage, its expert-parallel share of
each MoE layer's routed experts (numbered from 0 on every expert-parallel rank), and, under bf16/fp16, an fp32
main copy of each parameter inside the optimizer next to the 16-bit model weight. A checkpoint of those
shards would only load at the layout that wrote it (USER_REPORTS E: "adapter save keeps one TP shard",
non-reshardable checkpoints). Here every rank turns its shards into *canonical* tensors instead:

* name: the Megatron parameter name with the global layer number, the global expert number
  (`mlp.experts.local_experts.<e>`, e = `MoELayer.local_expert_indices[local]`) and no `chunk<i>.` /
  `module.` prefix (`decoder.layers.3.self_attention.linear_qkv.adapter.linear_out.weight`), identical at any
  TP/PP/VPP/EP;
* value: the fp32 main parameter (what the optimizer steps; the bf16 model weight is a rounding of it),
  gathered over the tensor-parallel group along `partition_dim` (the expert-tensor-parallel group for a routed
  expert's tensor). A gated MLP's `linear_fc1` rows are [gate; up] on each rank, so its shards are gathered
  half by half (gate shards, then up shards), which is the TP=1 layout;
* Adam: `<name>:exp_avg`, `<name>:exp_avg_sq` (same layout as the value) and `<name>:step`.

`gather_state` is collective over the world and returns the full tensors on global rank 0: the first rank of
each (expert) tensor-parallel group in the first (expert) data-parallel replica sends its tensors there, so
each pipeline stage's layers and each routed expert, with its Adam moments, arrive once whatever the layout.
`load_state` is the inverse on every rank: each cuts its shard out of the full tensors (its own experts by
their global numbers), writes the main parameter and the model weight from it, and rebuilds Adam's state. A
checkpoint whose names are not exactly the model's trainable tensors (of all ranks together) and their Adam
state, or whose shapes do not fit, is refused naming the tensors.

Not covered (refused at validation, recipe/checks/checkpoints.py): the distributed optimizer (its main
parameters live in flat buffers sharded over data-parallel ranks).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlbridge import faults
from rlbridge.engines.megatron.params import named_parameters
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.checks.checkpoints import unsaved_layouts
from rlbridge.recipe.schema import Recipe

FORMAT = "megatron-canonical-v1"
MOMENTS = ("exp_avg", "exp_avg_sq")
_LAYER = re.compile(r"^(?:chunk(\d+)\.)?(.*?decoder\.layers\.)(\d+)(\..*)$")
_CHUNK = re.compile(r"^chunk(\d+)\.")
_LOCAL_EXPERT = re.compile(r"^(\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def unsupported(recipe: Recipe) -> str | None:
    """Why checkpoints of this megatron layout cannot be written, or None (validation refuses such a recipe:
    recipe/checks/checkpoints.py)."""
    return "; ".join(str(i) for i in unsaved_layouts(recipe)) or None


# ---------------------------------------------------------------------------------------- names
def _layers(model: list[torch.nn.Module]) -> list[list[tuple[int, list[int]]]]:
    """Per chunk, per local layer: (global layer index, global index of each local expert; [] if no MoE)."""
    from megatron.core.utils import unwrap_model

    out = []
    for chunk in unwrap_model(model):
        decoder = getattr(chunk, "decoder", None)
        layers = getattr(decoder, "layers", []) if decoder is not None else []
        out.append(
            [
                (
                    int(layer.layer_number) - 1,
                    [
                        int(e)
                        for e in getattr(getattr(layer, "mlp", None), "local_expert_indices", None) or []
                    ],
                )
                for layer in layers
            ]
        )
    return out


def is_expert(name: str) -> bool:
    """A routed expert's tensor (sharded over expert parallel; a shared expert is not one)."""
    return ".mlp.experts." in name


def _expert_parallel() -> int:
    from megatron.core import parallel_state as ps

    return int(ps.get_expert_model_parallel_world_size())


def canonical_params(model: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) of every trainable parameter of this rank."""
    layers = _layers(model)
    for local_name, p in named_parameters(model):
        if not p.requires_grad:
            continue
        chunk = int(m.group(1)) if (m := _CHUNK.match(local_name)) else 0
        name = _CHUNK.sub("", local_name)
        if (m := _LAYER.match(name)) is not None:
            number, experts = layers[chunk][int(m.group(3))]
            rest = m.group(4)
            if (e := _LOCAL_EXPERT.match(rest)) is not None:
                rest = f"{e.group(1)}{experts[int(e.group(2))]}{e.group(3)}"
            elif (
                is_expert(rest) and _expert_parallel() > 1
            ):  # e.g. TE's grouped `experts.linear_fc1.weight<e>`
                raise RlbridgeError(
                    f"checkpoint: cannot name expert tensor {local_name} by its global expert (only "
                    "SequentialMLP's `local_experts.<i>` are renumbered; use the local layer spec)"
                )
            name = f"{m.group(2)}{number}{rest}"
        yield name, p


def _main_params(optimizer: Any) -> tuple[dict[int, Tensor], dict[int, Any]]:
    """id(model param) -> the tensor the optimizer steps (fp32 main copy, or the parameter itself), and
    id(model param) -> the torch optimizer holding its state."""
    mains: dict[int, Tensor] = {}
    owners: dict[int, Any] = {}
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        if hasattr(sub, "float16_groups"):
            for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups, strict=True):
                for p, main in zip(model_group, main_group, strict=True):
                    mains[id(p)], owners[id(p)] = main, inner
            for group in sub.fp32_from_fp32_groups:
                for p in group:
                    mains[id(p)], owners[id(p)] = p, inner
        else:
            for group in inner.param_groups:
                for p in group["params"]:
                    mains[id(p)], owners[id(p)] = p, inner
    return mains, owners


# ------------------------------------------------------------------------------------- sharding
def _is_glu_rows(name: str, p: Tensor, gated: bool) -> bool:
    """Rows of a gated linear_fc1's output ([gate; up] per rank): its weight, bias, and LoRA's linear_out. Not
    LoRA's linear_in, whose rows (the adapter rank) Megatron-Bridge may shard too."""
    return (
        gated
        and "linear_fc1." in name
        and ".linear_in." not in name
        and int(getattr(p, "partition_dim", 0)) == 0
    )


def _tp_group(name: str) -> tuple[int, int, Any]:
    """(size, rank, group) of the tensor-parallel group that shards `name`: expert tensor parallel for a
    routed expert's tensor, tensor parallel otherwise."""
    from megatron.core import parallel_state as ps

    if is_expert(name):
        return (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def _tp_gather(name: str, shard: Tensor, p: Tensor, gated: bool) -> Tensor:
    tp, _, group = _tp_group(name)
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return shard
    dim = int(getattr(p, "partition_dim", 0))
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    if _is_glu_rows(name, p, gated):
        halves = [part.chunk(2, 0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim)


def _tp_shard(name: str, full: Tensor, p: Tensor, gated: bool) -> Tensor:
    tp, rank, _ = _tp_group(name)
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return full
    dim = int(getattr(p, "partition_dim", 0))
    if _is_glu_rows(name, p, gated):
        return torch.cat([half.chunk(tp, 0)[rank] for half in full.chunk(2, 0)])
    return full.chunk(tp, dim)[rank]


def _gated(model: list[torch.nn.Module]) -> bool:
    from megatron.core.utils import unwrap_model

    return bool(getattr(unwrap_model(model)[0].config, "gated_linear_unit", False))


def _sends(name: str) -> bool:
    """Whether this rank sends `name` to the writer: the first rank of its (expert) tensor-parallel group in
    the first (expert) data-parallel replica. Each routed expert lives on one expert-parallel rank, so every
    expert is sent once whatever the expert-parallel size; pipeline stages send their own layers."""
    from megatron.core import parallel_state as ps

    if is_expert(name):
        return ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


# ------------------------------------------------------------------------------------ save / load
def gather_state(model: list[torch.nn.Module], optimizer: Any) -> dict[str, dict[str, Tensor]]:
    """Collective over the world: {"trainable": {name: fp32 full}, "optimizer": {name:key: full}} on global
    rank 0, {} on every other rank. See the module docstring."""
    mains, owners = _main_params(optimizer)
    gated = _gated(model)
    trainable: dict[str, Tensor] = {}
    moments: dict[str, Tensor] = {}
    for name, p in canonical_params(model):
        main = mains.get(id(p), p)
        full = _tp_gather(name, main.detach().float(), p, gated).cpu()
        state = owners[id(p)].state.get(main) if id(p) in owners else None
        mine = _sends(name)
        if mine:
            trainable[name] = full
        if state:
            for key in MOMENTS:
                full = _tp_gather(name, state[key].detach().float(), p, gated).cpu()
                if mine:
                    moments[f"{name}:{key}"] = full
            if mine:
                moments[f"{name}:step"] = (
                    torch.as_tensor(state["step"], dtype=torch.float32).reshape(()).cpu()
                )
    part = {"trainable": trainable, "optimizer": moments}
    faults.pause("checkpoint-gather")  # tests kill one rank here (rlbridge/faults.py); a no-op otherwise
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(part, parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return {}
    out: dict[str, dict[str, Tensor]] = {"trainable": {}, "optimizer": {}}
    for part in parts:
        for group, tensors in (part or {}).items():
            for key, tensor in tensors.items():
                have = out[group].get(key)
                if have is not None and not torch.equal(have, tensor):
                    raise RlbridgeError(f"checkpoint: {key} is sent by two ranks with different values")
                out[group][key] = tensor
    return out


def _world_names(names: set[str]) -> set[str]:
    """The canonical names of every rank (collective): what the whole model trains, at any layout."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return set(names)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sorted(names))
    return {n for part in parts for n in part}


def check_names(tensors: Any, moments: Any, names: set[str], what: str) -> None:
    """Refuse a checkpoint whose tensors are not exactly the model's trainable tensors (`names`, of every rank)
    and their Adam state, naming the tensors that differ."""
    missing = sorted(names - set(tensors))
    if missing:
        raise RlbridgeError(
            f"{what}: the checkpoint lacks {len(missing)} trainable tensor(s) of this model, e.g. "
            f"{missing[:3]} (a checkpoint of another model, LoRA rank or targets?)"
        )
    extra = sorted(set(tensors) - names)
    if extra:
        raise RlbridgeError(
            f"{what}: the checkpoint holds {len(extra)} tensor(s) this model does not train, e.g. "
            f"{extra[:3]} (a checkpoint of another model, LoRA rank or targets?)"
        )
    keys = (*MOMENTS, "step")
    stray = sorted(
        k for k in moments if k.rpartition(":")[0] not in names or k.rpartition(":")[2] not in keys
    )
    partial = sorted(n for n in names if 0 < sum(f"{n}:{k}" in moments for k in keys) < len(keys))
    if stray or partial:
        raise RlbridgeError(
            f"{what}: the checkpoint's optimizer state does not fit this model: "
            + (f"{len(stray)} entries for no trainable tensor, e.g. {stray[:3]}" if stray else "")
            + ("; " if stray and partial else "")
            + (f"{len(partial)} tensor(s) with part of Adam's state, e.g. {partial[:3]}" if partial else "")
        )


def load_state(
    model: list[torch.nn.Module],
    optimizer: Any,
    tensors: dict[str, Tensor],
    moments: dict[str, Tensor],
    what: str,
) -> None:
    """Collective over the world: restore this rank's shards from full canonical tensors (see
    `gather_state`). The checkpoint must hold every trainable tensor of the model (of every rank) with its
    full shape, and nothing else."""
    mains, owners = _main_params(optimizer)
    gated = _gated(model)
    params = list(canonical_params(model))
    check_names(tensors, moments, _world_names({n for n, _ in params}), what)
    for owner in {id(o): o for o in owners.values()}.values():
        owner.state.clear()
    with torch.no_grad():
        for name, p in params:
            main = mains.get(id(p), p)
            shard = _tp_shard(name, tensors[name], p, gated)
            if shard.shape != main.shape:
                raise RlbridgeError(
                    f"{what}: {name} has shape {tuple(tensors[name].shape)} in the checkpoint, "
                    f"which does not fit this model's {tuple(main.shape)} shard (another model?)"
                )
            main.copy_(shard.to(main.dtype))
            if main is not p:
                p.copy_(main.to(p.dtype))
            if f"{name}:exp_avg" not in moments:
                continue
            state: dict[str, Any] = {
                k: _tp_shard(name, moments[f"{name}:{k}"], p, gated).to(main.device, main.dtype)
                for k in MOMENTS
            }
            state["step"] = moments[f"{name}:step"].clone().to(torch.float32)
            owners[id(p)].state[main] = state
