"""Per-expert bookkeeping for mixture-of-experts models, shared by both trainer engines (pure torch).

The first-step gate (trainer/gate.py) proves that training reaches every tensor it should. On an MoE model a
whole-tensor check is not enough: an expert's LoRA can stay dead while the rest trains (Megatron-Bridge #5635:
expert LoRA that "silently compute[s] the wrong numbers" or is "detached from autograd"), and an expert that no
token was routed to legitimately gets no gradient. So each engine reports

* `routed_tokens()`: how many tokens the router sent to each expert in the training forwards (forwards with
  gradients) since the last call, summed over all ranks, keyed by `ExpertId` = (MoE layer, global expert index);
* `expert_views(state)`: the part of each trainable tensor that belongs to one expert (a whole tensor for
  Megatron's per-expert linear layers; rows of A and columns of B for peft's LoRA on stacked 3D expert weights),

and `expert_report` compares the views before and after the first updates: every expert that received tokens
must have changed; experts that received none are named, not failed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

ExpertId = tuple[int, int]
"""(decoder layer number, global expert index)."""


class RoutedTokens:
    """Tokens routed per expert, accumulated by router hooks (only forwards that build a graph count). The counts
    stay on the router's device until `take`: one host copy per take, not one per layer and forward (each a
    device sync on a GPU)."""

    def __init__(self) -> None:
        self._counts: dict[int, torch.Tensor] = {}

    def add(
        self, layer: int, expert_indices: torch.Tensor, num_experts: int, tokens: torch.Tensor | None = None
    ) -> None:
        """`expert_indices`: the chosen experts of each token ([tokens, k] or [tokens] ints), or a [tokens,
        experts] bool routing map. `tokens`: a [tokens] bool mask of the positions to count (the real tokens of
        a padded forward; None, or a mask of another length than the router's rows, e.g. a router that sees a
        sequence-parallel slice: all)."""
        if not torch.is_grad_enabled():
            return
        if tokens is not None and expert_indices.shape[0] != tokens.numel():
            tokens = None
        if expert_indices.dtype == torch.bool:
            routed = expert_indices.reshape(-1, num_experts)
            if tokens is not None:
                routed = routed & tokens.reshape(-1, 1)
            counts = routed.sum(0, dtype=torch.int64)
        else:
            chosen = expert_indices.long()
            chosen = chosen.flatten(1) if chosen.dim() > 1 else chosen[:, None]  # [tokens, k]
            weight = (chosen >= 0) & (chosen < num_experts)  # an index outside the experts counts for none
            if tokens is not None:
                weight &= tokens.reshape(-1, 1)
            counts = torch.zeros(num_experts, dtype=torch.int64, device=chosen.device)
            counts.scatter_add_(0, chosen.clamp(0, num_experts - 1).reshape(-1), weight.reshape(-1).long())
        counts = counts.detach()
        self._counts[layer] = self._counts[layer] + counts if layer in self._counts else counts

    def take(self) -> dict[ExpertId, int]:
        """Counts since the last take (this process only), then reset."""
        out = {
            (layer, e): int(c) for layer, t in self._counts.items() for e, c in enumerate(t.cpu().tolist())
        }
        self._counts = {}
        return out


def sum_counts(parts: Iterable[dict[ExpertId, int]]) -> dict[ExpertId, int]:
    out: dict[ExpertId, int] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out


@dataclass(frozen=True)
class ExpertReport:
    trained: list[ExpertId]
    """Experts that received tokens and every one of whose trainable tensors (parts) changed."""
    dead: list[ExpertId]
    """Experts that received tokens but with a trainable tensor (part) that did not change: the failure the gate
    exists for."""
    unrouted: list[ExpertId]
    """Experts no token was routed to (no gradient expected)."""

    def describe(self, ids: list[ExpertId], limit: int = 6) -> str:
        text = ", ".join(f"layer {layer} expert {e}" for layer, e in ids[:limit])
        return text + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")


def expert_report(
    before: dict[ExpertId, list[torch.Tensor]],
    after: dict[ExpertId, list[torch.Tensor]],
    routed: dict[ExpertId, int],
) -> ExpertReport:
    trained, dead, unrouted = [], [], []
    for key in sorted(before):
        changed = all(not torch.equal(a, b) for a, b in zip(before[key], after[key], strict=True))
        if routed.get(key, 0) == 0:
            unrouted.append(key)
        elif changed:
            trained.append(key)
        else:
            dead.append(key)
    return ExpertReport(trained=trained, dead=dead, unrouted=unrouted)
