"""MoE layers of a Megatron model: router hooks that count routed tokens, and which trainable tensor is which
expert's (rlbridge/engines/moe.py says why the first-step gate needs both).

megatron-core's MoE layer (`MoELayer`) holds a router (`TopKRouter`, returning (probs, routing_map) with a
[tokens, experts] bool map over all experts) and, without Transformer Engine, a `SequentialMLP` of per-expert
linear layers `mlp.experts.local_experts.<local index>`; the global index of a local expert is
`MoELayer.local_expert_indices[local]` (offset by the expert-parallel rank). Layer numbers are global
(`layer_number` - 1), so pipeline stages and virtual chunks agree.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from rlbridge.engines.moe import ExpertId, RoutedTokens, sum_counts

_LOCAL_EXPERT = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.")


class MoeBook:
    """Router hooks on every MoE layer of the model chunks, and the trainable-name -> expert map."""

    def __init__(self, model: list[torch.nn.Module], trainable: list[tuple[str, torch.nn.Parameter]]) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.utils import unwrap_model

        self.counter = RoutedTokens()
        self.num_layers = 0
        self._tokens: torch.Tensor | None = None
        """The current forward's real positions in the routers' order ([S x m] bool, sequence-major), or None."""
        global_layer: dict[tuple[int, int], int] = {}
        global_expert: dict[int, list[int]] = {}
        for ci, chunk in enumerate(unwrap_model(model)):
            chunk.register_forward_pre_hook(self._note_tokens, with_kwargs=True)
            for local, layer in enumerate(chunk.decoder.layers):
                mlp = getattr(layer, "mlp", None)
                if not isinstance(mlp, MoELayer):
                    continue
                self.num_layers += 1
                number = int(layer.layer_number) - 1
                global_layer[(ci, local)] = number
                global_expert[number] = list(mlp.local_expert_indices)
                mlp.router.register_forward_hook(self._hook(number, int(mlp.config.num_moe_experts)))
        self.expert_of: dict[str, ExpertId] = {}
        for name, _ in trainable:
            ci, rest = 0, name
            if name.startswith("chunk"):
                head, rest = name.split(".", 1)
                ci = int(head[len("chunk") :])
            m = _LOCAL_EXPERT.search(rest)
            if m is None:
                continue
            number = global_layer[(ci, int(m.group(1)))]
            self.expert_of[name] = (number, global_expert[number][int(m.group(2))])

    def _note_tokens(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """Before a chunk's forward: its real positions, from the micro-batch's [m, 1, S, S] mask (True: not
        allowed; a padding position may not attend to itself, a real one may), sequence-major as the routers see
        them. Padding is routed too but carries no gradient: counted, it would excuse an expert only padding
        reached from the first-step gate."""
        mask = kwargs.get("attention_mask")
        self._tokens = None
        if torch.is_tensor(mask) and mask.dim() == 4 and mask.dtype == torch.bool:
            self._tokens = (~mask[:, 0].diagonal(dim1=1, dim2=2)).transpose(0, 1).reshape(-1)

    def _hook(self, layer: int, num_experts: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            # under sequence or context parallelism this rank's router sees a slice: RoutedTokens counts it all
            self.counter.add(layer, output[1], num_experts, self._tokens)

        return hook

    def routed_tokens(self) -> dict[ExpertId, int]:
        """Collective over all ranks: tokens each expert received in the training forwards since the last call
        (each rank's router sees its own tokens; an expert on one rank receives them from its whole group)."""
        mine = self.counter.take()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return mine
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        return sum_counts(parts)

    def expert_views(self, state: dict[str, torch.Tensor]) -> dict[ExpertId, list[torch.Tensor]]:
        out: dict[ExpertId, list[torch.Tensor]] = {}
        for name, key in self.expert_of.items():
            if name in state:
                out.setdefault(key, []).append(state[name])
        return out
