"""Names of a mixture-of-experts model's experts, for the trainer engines and the rollout alike: the decoder layer
a module or tensor belongs to, and per-expert checkpoint tensors turned into transformers' stacked parameters.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer index a module or tensor name belongs to (`...layers.<i>....`), or None."""
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


_CHECKPOINT_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_expert_weights(tensors: dict[str, torch.Tensor], model_keys: set[str]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (`mlp.experts.<e>.gate_proj.weight`, what exports and vLLM use) -> the stacked
    parameters of a transformers 5 model (`mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert,
    `mlp.experts.down_proj` [E, H, I]) where `model_keys` has them; other tensors pass through unchanged."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        m = _CHECKPOINT_EXPERT.match(name)
        if m is None or f"{m.group(1)}.gate_up_proj" not in model_keys:
            out[name] = tensor
            continue
        groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
    for prefix, experts in groups.items():
        order = sorted(experts)
        if order != list(range(len(order))) or any(len(experts[e]) != 3 for e in order):
            raise ValueError(f"{prefix}: expected gate, up and down weights of experts 0..{len(order) - 1}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out
