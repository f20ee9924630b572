"""Layout-portable checkpoint state of a megatron model: full tensors under canonical names.

A megatron rank holds shards: its tensor-parallel slice of each trainable tensor, the layers of its pipeline
stage (numbered from 0 on every stage), a `chunk<i>.` prefix per virtual stage, and, under bf16/fp16, an fp32
main copy of each parameter inside the optimizer next to the 16-bit model weight. A checkpoint of those
shards would only load at the layout that wrote it (USER_REPORTS E: "adapter save keeps one TP shard",
non-reshardable checkpoints). Here every rank turns its shards into *canonical* tensors instead:

* name: the Megatron parameter name with the global layer number and no `chunk<i>.` / `module.` prefix
  (`decoder.layers.3.self_attention.linear_qkv.adapter.linear_out.weight`), identical at any TP/PP/VPP;
* value: the fp32 main parameter (what the optimizer steps; the bf16 model weight is a rounding of it),
  gathered over the tensor-parallel group along `partition_dim`. A gated MLP's `linear_fc1` rows are
  [gate; up] on each rank, so its shards are gathered half by half (gate shards, then up shards), which is
  the TP=1 layout;
* Adam: `<name>:exp_avg`, `<name>:exp_avg_sq` (same layout as the value) and `<name>:step`.

`gather_state` is collective over the world and returns the full tensors on global rank 0 (pipeline stages
send theirs there; only tensor rank 0 of data-parallel replica 0 sends); `load_state` is the inverse on
every rank: each cuts its shard out of the full tensors, writes the main parameter and the model weight
from it, and rebuilds Adam's state. Names or shapes that do not match the model are errors naming them.

Not covered (refused at validation, recipe/checks/checkpoints.py): the distributed optimizer (its main parameters live in flat
buffers sharded over data-parallel ranks) and expert parallelism (local expert indices would need
renaming to global ones).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlbridge.engines.megatron.params import named_parameters
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.checks.checkpoints import unsaved_layouts
from rlbridge.recipe.schema import Recipe

FORMAT = "megatron-canonical-v1"
MOMENTS = ("exp_avg", "exp_avg_sq")
_LAYER = re.compile(r"^(?:chunk(\d+)\.)?(.*?decoder\.layers\.)(\d+)(\..*)$")
_CHUNK = re.compile(r"^chunk(\d+)\.")


def unsupported(recipe: Recipe) -> str | None:
    """Why checkpoints of this megatron layout cannot be written, or None (validation refuses such a recipe:
    recipe/checks/checkpoints.py)."""
    issues = [str(i) for i in unsaved_layouts(recipe)]
    if recipe.trainer.parallel.expert > 1:
        issues.append("checkpoints at trainer.parallel.expert > 1 are not implemented yet; use expert: 1")
    return "; ".join(issues) or None


# ---------------------------------------------------------------------------------------- names
def _global_layers(model: list[torch.nn.Module]) -> list[list[int]]:
    """Per chunk: local layer index -> global layer index (0-based)."""
    from megatron.core.utils import unwrap_model

    out = []
    for chunk in unwrap_model(model):
        decoder = getattr(chunk, "decoder", None)
        layers = getattr(decoder, "layers", []) if decoder is not None else []
        out.append([int(layer.layer_number) - 1 for layer in layers])
    return out


def canonical_params(model: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) of every trainable parameter of this rank."""
    numbers = _global_layers(model)
    for name, p in named_parameters(model):
        if not p.requires_grad:
            continue
        chunk = int(m.group(1)) if (m := _CHUNK.match(name)) else 0
        name = _CHUNK.sub("", name)
        if (m := _LAYER.match(name)) is not None:
            name = f"{m.group(2)}{numbers[chunk][int(m.group(3))]}{m.group(4)}"
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


def _tp_gather(name: str, shard: Tensor, p: Tensor, gated: bool) -> Tensor:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return shard
    dim = int(getattr(p, "partition_dim", 0))
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
    if _is_glu_rows(name, p, gated):
        halves = [part.chunk(2, 0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim)


def _tp_shard(name: str, full: Tensor, p: Tensor, gated: bool) -> Tensor:
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return full
    dim = int(getattr(p, "partition_dim", 0))
    if _is_glu_rows(name, p, gated):
        return torch.cat([half.chunk(tp, 0)[rank] for half in full.chunk(2, 0)])
    return full.chunk(tp, dim)[rank]


def _gated(model: list[torch.nn.Module]) -> bool:
    from megatron.core.utils import unwrap_model

    return bool(getattr(unwrap_model(model)[0].config, "gated_linear_unit", False))


# ------------------------------------------------------------------------------------ save / load
def gather_state(model: list[torch.nn.Module], optimizer: Any) -> dict[str, dict[str, Tensor]]:
    """Collective over the world: {"trainable": {name: fp32 full}, "optimizer": {name:key: full}} on global
    rank 0, {} on every other rank. See the module docstring."""
    from megatron.core import parallel_state as ps

    mains, owners = _main_params(optimizer)
    gated = _gated(model)
    trainable: dict[str, Tensor] = {}
    moments: dict[str, Tensor] = {}
    for name, p in canonical_params(model):
        main = mains.get(id(p), p)
        trainable[name] = _tp_gather(name, main.detach().float(), p, gated).cpu()
        state = owners[id(p)].state.get(main) if id(p) in owners else None
        if state:
            for key in MOMENTS:
                moments[f"{name}:{key}"] = _tp_gather(name, state[key].detach().float(), p, gated).cpu()
            moments[f"{name}:step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(()).cpu()
    sender = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    mine = {"trainable": trainable, "optimizer": moments} if sender else {}
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return {}
    out: dict[str, dict[str, Tensor]] = {"trainable": {}, "optimizer": {}}
    for part in parts:
        for group, tensors in (part or {}).items():
            for key, tensor in tensors.items():
                have = out[group].get(key)
                if have is not None and not torch.equal(have, tensor):
                    raise RlbridgeError(
                        f"checkpoint: {key} is held by two pipeline stages with different values"
                    )
                out[group][key] = tensor
    return out


def load_state(
    model: list[torch.nn.Module],
    optimizer: Any,
    tensors: dict[str, Tensor],
    moments: dict[str, Tensor],
    what: str,
) -> None:
    """Restore this rank's shards from full canonical tensors (see `gather_state`); every trainable
    parameter must be present with its full shape, and nothing else."""
    mains, owners = _main_params(optimizer)
    gated = _gated(model)
    params = list(canonical_params(model))
    names = {n for n, _ in params}
    missing = sorted(names - tensors.keys())
    if missing:
        raise RlbridgeError(
            f"{what}: the checkpoint lacks {len(missing)} trainable tensor(s) of this model, e.g. "
            f"{missing[:3]} (a checkpoint of another model, LoRA rank or targets?)"
        )
    from megatron.core.utils import unwrap_model

    num_layers = int(unwrap_model(model)[0].config.num_layers)
    extra = _extra(tensors.keys(), params, num_layers)
    if extra:
        raise RlbridgeError(
            f"{what}: the checkpoint holds {len(extra)} tensor(s) this model does not train, e.g. "
            f"{extra[:3]} (a checkpoint of another model, LoRA rank or targets?)"
        )
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


def _extra(keys: Any, params: list[tuple[str, torch.nn.Parameter]], num_layers: int) -> list[str]:
    """Checkpoint tensors this model does not train at any layout. Other pipeline stages' layers are
    expected here, so a layer tensor is extra when its layer number is beyond the model or its module path
    is one no layer of this rank has; other names must be this rank's or belong to another stage."""
    suffixes = {m.group(4) for n, _ in params if (m := _LAYER.match(n)) is not None}
    out = []
    for key in keys:
        m = _LAYER.match(key)
        if m is not None and suffixes and (int(m.group(3)) >= num_layers or m.group(4) not in suffixes):
            out.append(key)
    return sorted(out)
