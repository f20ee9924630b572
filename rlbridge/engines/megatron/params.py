"""Which tensors train, and proof that the trainer, the optimizer and the gradient buffers agree on it.

USER_REPORTS A / R4: PEFT applied after the DDP / optimizer wrap leaves the grad buffers and the optimizer
holding the wrong parameter set (KeyErrors at best, silently frozen adapters at worst). The engine applies
PEFT as a pre-wrap hook, records the trainable set at that moment, and `check_param_sets` then asserts:
trainable at wrap time == trainable now == optimizer params == grad-buffer params == adapters (under LoRA;
every parameter under full fine-tuning).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlbridge.errors import RlbridgeError


def clean_name(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def named_parameters(model: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, param) over all model chunks; names carry `chunk<i>.` only with virtual pipeline stages."""
    for i, chunk in enumerate(model):
        prefix = f"chunk{i}." if len(model) > 1 else ""
        for name, param in chunk.named_parameters():
            yield prefix + clean_name(name), param


def is_adapter(name: str) -> bool:
    return ".adapter." in name


@dataclass(frozen=True)
class ParamSets:
    at_wrap: frozenset[str]
    trainable: frozenset[str]
    optimizer: frozenset[str]
    grad_buffers: frozenset[str]
    adapters: frozenset[str]
    """Adapter tensors (LoRA), or every parameter (full fine-tuning): what should train."""


def optimizer_params(optimizer: object) -> list[torch.nn.Parameter]:
    """The model parameters an optimizer updates (for mixed precision: the model params, not the fp32
    main copies it keeps)."""
    out: list[torch.nn.Parameter] = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(sub, "float16_groups"):
            for group in list(sub.float16_groups) + list(sub.fp32_from_fp32_groups):
                out.extend(group)
        else:
            for group in sub.optimizer.param_groups:  # type: ignore[attr-defined]  # megatron's chained optimizer: its parts are typed as the base class
                out.extend(group["params"])
    return out


def grad_buffer_params(model: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    out: list[torch.nn.Parameter] = []
    for chunk in model:
        for buffer in list(getattr(chunk, "buffers", [])) + list(
            getattr(chunk, "expert_parallel_buffers", [])
        ):
            out.extend(buffer.params)
    return out


def param_sets(model: list[torch.nn.Module], optimizer: object, at_wrap: set[str], lora: bool) -> ParamSets:
    names = {id(p): n for n, p in named_parameters(model)}
    everything = set(names.values())
    return ParamSets(
        at_wrap=frozenset(at_wrap),
        trainable=frozenset(n for n, p in named_parameters(model) if p.requires_grad),
        optimizer=frozenset(names.get(id(p), "<not a model parameter>") for p in optimizer_params(optimizer)),
        grad_buffers=frozenset(
            names.get(id(p), "<not a model parameter>") for p in grad_buffer_params(model)
        ),
        adapters=frozenset(n for n in everything if is_adapter(n)) if lora else frozenset(everything),
    )


def check_param_sets(sets: ParamSets) -> None:
    """Raise naming the first differences unless all five sets are equal and non-empty."""
    problems = []
    for label in ("at_wrap", "trainable", "optimizer", "grad_buffers"):
        got: frozenset[str] = getattr(sets, label)
        if got != sets.adapters:
            missing = sorted(sets.adapters - got)[:3]
            extra = sorted(got - sets.adapters)[:3]
            problems.append(f"{label}: missing {missing}, unexpected {extra}")
    if not sets.adapters:
        problems.append("nothing to train")
    if problems:
        raise RlbridgeError(
            "trainable parameter sets disagree (PEFT must wrap before DDP/optimizer): " + "; ".join(problems)
        )


def trainable(model: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in named_parameters(model) if p.requires_grad]


def main_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad
