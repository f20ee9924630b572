"""What every trainer engine shares about its optimizer, with no engine library imported: the learning-rate
schedule (`lr_at`) and the named AdamW state that checkpoints store (`adamw_state` / `load_adamw_state`).
How many optimizer steps a run takes is the plan's arithmetic (plan.total_optimizer_steps)."""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import Tensor, nn

from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import OptimCfg

_OPTIM_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def lr_at(optim: OptimCfg, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up to `lr` over warmup_steps (the
    first step already uses lr / warmup_steps), then constant, or a cosine / linear decay that reaches
    min_lr at `total_steps`."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1.0 - progress
    return optim.min_lr + (optim.lr - optim.min_lr) * factor


def adamw_state(
    optimizer: torch.optim.Optimizer, trainable: list[tuple[str, nn.Parameter]], scheduler: dict[str, int]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The state of `optimizer` over the named parameters `trainable` as tensors `<name>:step|exp_avg|exp_avg_sq`
    and JSON metadata ("adamw-v1": names with state, `scheduler`, hyper-parameters of the first group)."""
    tensors: dict[str, Tensor] = {}
    names: list[str] = []
    for n, p in trainable:
        state = optimizer.state.get(p)
        if not state:
            continue
        names.append(n)
        for key in _OPTIM_STATE_KEYS:
            tensors[f"{n}:{key}"] = state[key].detach().clone()
    group = optimizer.param_groups[0]
    meta = {
        "format": "adamw-v1",
        "names": names,
        "scheduler": scheduler,
        "hyper": {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")},
    }
    return tensors, json.loads(json.dumps(meta))


def load_adamw_state(
    optimizer: torch.optim.Optimizer,
    trainable: list[tuple[str, nn.Parameter]],
    tensors: dict[str, Tensor],
    meta: dict[str, Any],
) -> None:
    """Inverse of adamw_state (the hyper-parameters stay the recipe's)."""
    if meta.get("format") != "adamw-v1":
        raise RlbridgeError(f"unknown optimizer state format {meta.get('format')!r}")
    params = dict(trainable)
    unknown = [n for n in meta["names"] if n not in params]
    if unknown:
        raise RlbridgeError(f"optimizer state for tensors the model does not train: {unknown[:3]}")
    optimizer.state.clear()
    for n in meta["names"]:
        p = params[n]
        state = {k: tensors[f"{n}:{k}"].clone() for k in _OPTIM_STATE_KEYS}
        state["exp_avg"] = state["exp_avg"].to(p.device, p.dtype)
        state["exp_avg_sq"] = state["exp_avg_sq"].to(p.device, p.dtype)
        optimizer.state[p] = state
