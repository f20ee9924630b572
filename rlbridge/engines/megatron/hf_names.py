"""A megatron checkpoint's canonical LoRA tensors under the hf engine's PEFT names (pure torch, no Megatron).

`rlbridge export-hf` of a megatron run reads the checkpoint in a plain CPU process (no Ray, no GPU, no
Megatron) and hands the adapters to the hf engine's exporter, which merges in float32 with peft's arithmetic
or writes the PEFT adapter. Megatron-Bridge's LoRA and peft's compute the same update, scaled alpha / rank,
`B @ A`; only the fused projections differ:

* `linear_qkv`: one A (shared by q, k and v) and one B whose rows are grouped per key/value head:
  [q rows of the group's heads, k rows, v rows] for each of the num_key_value_heads groups. q_proj / k_proj /
  v_proj each get A, and their rows of B;
* `linear_fc1` (gated MLP): one A, B rows [gate; up] -> gate_proj and up_proj;
* `linear_proj` -> o_proj, `linear_fc2` -> down_proj.

The canonical names are engines/megatron/state.py's (global layer numbers, full tensors).
"""

from __future__ import annotations

import re
from typing import Any

from torch import Tensor

from rlbridge.errors import RlbridgeError

_NAME = re.compile(
    r"decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)"
    r"\.adapter\.linear_(in|out)\.weight"
)
_SINGLE = {"linear_proj": "self_attn.o_proj", "linear_fc2": "mlp.down_proj"}


def lora_to_peft(
    tensors: dict[str, Tensor], config: dict[str, Any], adapter: str = "default"
) -> dict[str, Tensor]:
    """Canonical megatron LoRA tensors -> `base_model.model.model.layers.<i>.<module>.lora_<A|B>.<adapter>.weight`,
    for an HF config (`config.json` content) of a Llama-like decoder (Llama, Qwen2, Mistral, ...)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    out: dict[str, Tensor] = {}

    def put(layer: str, module: str, which: str, t: Tensor) -> None:
        out[f"base_model.model.model.layers.{layer}.{module}.lora_{which}.{adapter}.weight"] = t.contiguous()

    for name, t in tensors.items():
        m = _NAME.fullmatch(name)
        if m is None:
            raise RlbridgeError(
                f"checkpoint tensor {name!r} is not a LoRA adapter of a decoder projection this "
                "export knows (linear_qkv, linear_proj, linear_fc1, linear_fc2)"
            )
        layer, target, side = m.group(1), m.group(3), m.group(4)
        if target in _SINGLE:
            put(layer, _SINGLE[target], "A" if side == "in" else "B", t)
        elif target == "linear_fc1":
            if side == "in":
                put(layer, "mlp.gate_proj", "A", t)
                put(layer, "mlp.up_proj", "A", t)
            else:
                gate, up = t.chunk(2, 0)
                put(layer, "mlp.gate_proj", "B", gate)
                put(layer, "mlp.up_proj", "B", up)
        elif side == "in":
            for proj in ("q_proj", "k_proj", "v_proj"):
                put(layer, f"self_attn.{proj}", "A", t)
        else:
            per_group = heads // kv_heads
            expected = (heads + 2 * kv_heads) * head_dim
            if t.shape[0] != expected:
                raise RlbridgeError(
                    f"{name}: {t.shape[0]} rows, expected {expected} for {heads} heads, "
                    f"{kv_heads} key/value heads of dim {head_dim} (a checkpoint of another model?)"
                )
            grouped = t.reshape(kv_heads, (per_group + 2) * head_dim, -1)
            q = grouped[:, : per_group * head_dim].reshape(heads * head_dim, -1)
            k = grouped[:, per_group * head_dim : (per_group + 1) * head_dim].reshape(kv_heads * head_dim, -1)
            v = grouped[:, (per_group + 1) * head_dim :].reshape(kv_heads * head_dim, -1)
            for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                put(layer, f"self_attn.{proj}", "B", part)
    return out
