"""The hf engine on mixture-of-experts models: LoRA on the stacked expert weights, their merge, and the per-expert
bookkeeping of the first-step gate (rlbridge/engines/moe.py).

transformers 5 stores an MoE layer's routed experts as stacked 3D parameters (`mlp.experts.gate_up_proj`
[experts, 2 x intermediate, hidden], `mlp.experts.down_proj` [experts, hidden, intermediate]); checkpoints keep
per-expert names (`mlp.experts.<e>.gate_proj.weight`), converted on load and back on save. There is no nn.Linear
per expert, so a peft `target_modules` list of gate_proj / up_proj / down_proj adapts the attention and *silently
no expert*. The experts are therefore adapted through peft's `target_parameters` (a `ParamWrapper` per stacked
parameter, one LoRA pair per expert packed into one A [experts x r', in] and one B [out, r' x experts]):

* expert e's rows of A are `A.reshape(E, -1, in)[e]`, its columns of B `B.reshape(out, -1, E)[..., e]` (peft's
  `get_delta_factors` layout), which is what the first-step gate compares per expert;
* the merged delta is peft's own `get_delta_weight` (einsum over the packed factors) in float32, added to the
  stacked base weight and converted back to per-expert names with the rest of the state.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from rlbridge.engines.moe import ExpertId, RoutedTokens
from rlbridge.model.experts import layer_of
from rlbridge.model.hf import LoraParamWrapper

_WRAPPERS = re.compile(r"(\.base_layer)+\.")


def clean_param_name(name: str) -> str:
    """A live (peft-wrapped) parameter name -> the transformers model's own name (nested wrappers included)."""
    return _WRAPPERS.sub(".", name)


def num_experts(config: Any) -> int:
    text = getattr(config, "text_config", None) or config
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def expert_parameters_present(model: nn.Module, names: list[str]) -> list[str]:
    """The `target_parameters` of `names` that some module of `model` holds as a 3D parameter."""
    have = {
        clean_param_name(n).split("layers.")[-1].split(".", 1)[-1]
        for n, p in model.named_parameters()
        if p.dim() == 3
    }
    return [n for n in names if n in have]


def merged_expert_weights(model: nn.Module, adapter: str) -> dict[str, Tensor]:
    """{transformers name of a stacked expert parameter: base + LoRA delta} (float32 merge, cast back)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraParamWrapper) or adapter not in module.lora_A:
            continue
        param = module.get_param()
        delta = module.get_delta_weight(adapter).float()
        if delta.shape != param.shape:
            raise ValueError(
                f"LoRA delta of {name} has shape {tuple(delta.shape)}, the weight {tuple(param.shape)}"
            )
        key = clean_param_name(f"{name}.{module.parameter_name}")
        out[key] = (param.detach().float() + delta).to(param.dtype)
    return out


class HfMoeBook:
    """Router hooks (tokens per expert in training forwards) and per-expert views of the packed expert LoRA."""

    def __init__(
        self, model: nn.Module, trainable: list[tuple[str, nn.Parameter]], num_experts: int, top_k: int
    ) -> None:
        self.counter = RoutedTokens()
        self.num_experts = num_experts
        self.top_k = top_k
        self._tokens: Tensor | None = None
        """The current forward's real positions, flattened ([b x width] bool; None: every position is one)."""
        model.register_forward_pre_hook(self._note_tokens, with_kwargs=True)
        for name, module in model.named_modules():
            if name.endswith("mlp.gate") and not isinstance(module, LoraParamWrapper):
                layer = layer_of(name)
                if layer is not None:
                    module.register_forward_hook(self._hook(layer))
        self._packed: dict[str, tuple[int, str]] = {}
        """trainable name -> (layer, "A" | "B") of a LoRA factor packed over the experts."""
        for name, _ in trainable:
            if ".mlp.experts." not in name or ".lora_" not in name:
                continue
            layer = layer_of(name)
            if layer is not None:
                self._packed[name] = (layer, "A" if ".lora_A." in name else "B")

    def _note_tokens(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """Before a model call: which of its input positions are real tokens. A padded pass's attention mask
        covers the cached positions first, then the input's (the shared prompts' second call), so its last
        columns are the input's; padding positions are routed too, but carry no gradient, and counted they
        would excuse an expert that only padding reached from the first-step gate. Packed passes have no mask
        and no padding."""
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        self._tokens = None
        if torch.is_tensor(ids) and torch.is_tensor(mask) and ids.dim() == 2 and mask.dim() == 2:
            if mask.shape[0] == ids.shape[0] and mask.shape[1] >= ids.shape[1]:
                self._tokens = mask[:, mask.shape[1] - ids.shape[1] :].reshape(-1).bool()

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, tuple):
                indices = next(
                    t for t in reversed(output) if torch.is_tensor(t) and not t.is_floating_point()
                )
            else:  # a router returning logits only
                indices = torch.topk(output, self.top_k, dim=-1).indices
            self.counter.add(layer, indices, self.num_experts, self._tokens)

        return hook

    def routed_tokens(self) -> dict[ExpertId, int]:
        return self.counter.take()

    def expert_views(self, state: dict[str, Tensor]) -> dict[ExpertId, list[Tensor]]:
        out: dict[ExpertId, list[Tensor]] = {}
        e_count = self.num_experts
        for name, (layer, kind) in self._packed.items():
            t = state.get(name)
            if t is None:
                continue
            for e in range(e_count):
                part = (
                    t.reshape(e_count, -1, t.shape[-1])[e]
                    if kind == "A"
                    else t.reshape(t.shape[0], -1, e_count)[..., e]
                )
                out.setdefault((layer, e), []).append(part)
        return out


def _weight_of(linear: nn.Module) -> nn.Parameter:
    weight = linear.weight
    assert isinstance(weight, nn.Parameter)
    return weight


_MEGATRON_EXPERT = re.compile(
    r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.adapter\.linear_(in|out)\.weight"
)


def megatron_experts_to_packed(
    model: nn.Module, tensors: dict[str, Tensor], *, scale: float, adapter: str = "default"
) -> dict[str, Tensor]:
    """A megatron checkpoint's per-expert LoRA (`...local_experts.<e>.linear_fc1.adapter.linear_in.weight`, canonical
    names: global layer and expert numbers, full tensors) -> the packed peft tensors of `model` (a peft model whose
    experts carry `target_parameters` LoRA), under `model.named_parameters()` names.

    Megatron's fc1 adapter is one A [r, hidden] shared by gate and up and one B [2 x intermediate, r] with rows
    [gate; up], its delta `scale * B @ A` (scale = alpha / rank); fc2's maps onto down_proj. peft packs k >= r
    rank slots per expert: expert e's slots get A in the first r rows and zeros after, B in the first r columns and
    zeros after, B multiplied by scale / peft's scaling so the delta is exactly Megatron's."""
    per: dict[tuple[int, str], dict[int, dict[str, Tensor]]] = {}
    for name, t in tensors.items():
        m = _MEGATRON_EXPERT.fullmatch(name)
        if m is None:
            raise ValueError(f"{name!r} is not a megatron expert LoRA tensor")
        number, expert, target, side = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        param = "gate_up_proj" if target == "linear_fc1" else "down_proj"
        per.setdefault((number, param), {}).setdefault(expert, {})[side] = t
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Tensor] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraParamWrapper) or adapter not in module.lora_A:
            continue
        found = layer_of(module_name)
        experts = per.pop((found, module.parameter_name), None) if found is not None else None
        if experts is None:
            continue
        layer = found
        a_param, b_param = _weight_of(module.lora_A[adapter]), _weight_of(module.lora_B[adapter])
        num = int(module.num_experts)
        if sorted(experts) != list(range(num)):
            raise ValueError(
                f"layer {layer} {module.parameter_name}: LoRA of experts {sorted(experts)}, not 0..{num - 1}"
            )
        a_packed = torch.zeros_like(a_param, dtype=torch.float32).reshape(num, -1, a_param.shape[-1])
        b_packed = torch.zeros_like(b_param, dtype=torch.float32).reshape(b_param.shape[0], -1, num)
        ratio = scale / float(module.scaling[adapter])
        for e, parts in experts.items():
            a, b = parts["in"].float(), parts["out"].float()
            r = a.shape[0]
            if r > a_packed.shape[1] or a.shape[1] != a_packed.shape[2] or b.shape[0] != b_packed.shape[0]:
                raise ValueError(
                    f"layer {layer} expert {e} {module.parameter_name}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} "
                    f"do not fit peft's packed {tuple(a_param.shape)} / {tuple(b_param.shape)}"
                )
            a_packed[e, :r] = a
            b_packed[:, :r, e] = b * ratio
        out[names[id(a_param)]] = a_packed.reshape(a_param.shape).to(a_param.dtype)
        out[names[id(b_param)]] = b_packed.reshape(b_param.shape).to(b_param.dtype)
    if per:
        raise ValueError(f"megatron expert LoRA without a peft expert module: {sorted(per)[:3]}")
    return out
