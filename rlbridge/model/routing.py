"""Routing replay on transformers MoE models: record which experts each token went to, and make a later forward
take exactly those experts (`rollout.routing_replay`, docs/moe.md).

Rollout and trainer compute the router's logits with different kernels; in bf16 a rounding difference can flip
which of two near-tied experts a token goes to, and that token's whole MLP output changes. Replaying the rollout's
choice removes that part of the trainer-vs-rollout gap. The replayed router keeps its own computation over the
given experts: transformers' `Qwen3MoeTopKRouter` takes softmax(logits) in float32, picks the top k and divides by
their sum when `norm_topk_prob`; the replay gathers the same probabilities at the given indices instead of the
top k, so the weights stay differentiable w.r.t. the router logits exactly as without replay.

Layout: a router sees its input as [rows x positions, hidden] (row-major), so the indices of a batch are one
integer tensor [rows, positions, MoE layers, k], layers in model order (`routers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from rlbridge.model.experts import layer_of


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers (`<...>.layers.<n>.mlp.gate`) of a transformers model, in layer order."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            layer = layer_of(name)
            if layer is not None:
                found[layer] = module
    return [found[k] for k in sorted(found)]


class RoutingRecorder:
    """Forward hooks on every router: the top-k indices of each call, joined along positions by `take`. Generation
    calls the model once on the prompts and then once per new token, so the calls concatenate to
    [rows, positions, layers, k] of every position the model ran on."""

    def __init__(self, model: nn.Module) -> None:
        self._routers = routers(model)
        if not self._routers:
            raise ValueError("routing replay needs an MoE model: no router (mlp.gate) found")
        self._calls: list[list[Tensor]] = [[] for _ in self._routers]
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingRecorder:
        for i, router in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._calls[layer].append(_indices_of(output).detach().to("cpu", torch.int16))

        return hook

    def take(self, num_rows: int) -> Tensor:
        """[rows, positions, layers, k] int16 of the calls so far (then forgotten)."""
        per_layer = [
            torch.cat([c.reshape(num_rows, -1, c.shape[-1]) for c in calls], dim=1) for calls in self._calls
        ]
        self._calls = [[] for _ in self._routers]
        return torch.stack(per_layer, dim=2)


def _indices_of(output: Any) -> Tensor:
    if isinstance(output, tuple):
        for t in reversed(output):
            if torch.is_tensor(t) and not t.is_floating_point():
                return t
    raise TypeError(
        "the router returned no integer top-k indices (expected transformers' (logits, scores, indices))"
    )


@contextlib.contextmanager
def replay_routing(model: nn.Module, indices_bslk: Tensor | None) -> Iterator[None]:
    """Within the block, every forward of `model` routes token (row b, position s) of MoE layer l to the experts
    `indices_bslk[b, s, l]`, weighted by the router's own probabilities of those experts. None: no replay."""
    if indices_bslk is None:
        yield
        return
    found = routers(model)
    if indices_bslk.shape[2] != len(found):
        raise ValueError(
            f"routing replay: indices for {indices_bslk.shape[2]} MoE layers, the model has {len(found)}"
        )
    handles = [r.register_forward_hook(_replay_hook(indices_bslk[:, :, i])) for i, r in enumerate(found)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay_hook(indices_bsk: Tensor) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        logits = output[0]
        top_k: Any = module.top_k
        k = int(top_k)
        if indices_bsk.shape[-1] != k:
            raise ValueError(
                f"routing replay: {indices_bsk.shape[-1]} experts per token given, the router takes {k}"
            )
        chosen = indices_bsk.reshape(-1, k).to(logits.device, torch.long)
        if chosen.shape[0] != logits.shape[0]:
            raise ValueError(
                f"routing replay: indices for {chosen.shape[0]} tokens, the router saw {logits.shape[0]}"
            )
        return (logits, *router_weights(module, logits, chosen))

    return hook


def router_weights(module: nn.Module, logits: Tensor, chosen: Tensor) -> tuple[Tensor, Tensor]:
    """(weights, indices) of transformers' top-k router with the experts `chosen` [tokens, k] instead of its top k:
    float32 softmax, gathered, renormalized when norm_topk_prob, cast to the logits' dtype."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    weights = probs.gather(-1, chosen)
    if getattr(module, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), chosen
