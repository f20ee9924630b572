"""LoRA target names: one vocabulary in the recipe, mapped to each engine's module names.

A recipe may name targets the Megatron way (`linear_qkv`) or the HF way (`q_proj`); the hf engine needs
HF module names, the megatron engine Megatron names. Unknown names are caught at validation.
"""

from __future__ import annotations

MEGATRON_TO_HF: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "linear_q": ("q_proj",),
    "linear_k": ("k_proj",),
    "linear_v": ("v_proj",),
    "linear_fc1_gate": ("gate_proj",),
    "linear_fc1_up": ("up_proj",),
}
HF_TO_MEGATRON: dict[str, str] = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
HF_TO_CANONICAL: dict[str, str] = {
    "q_proj": "linear_q",
    "k_proj": "linear_k",
    "v_proj": "linear_v",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1_gate",
    "up_proj": "linear_fc1_up",
    "down_proj": "linear_fc2",
}
ALL_LINEAR = "all-linear"
CANONICAL_ONLY = frozenset({"linear_q", "linear_k", "linear_v", "linear_fc1_gate", "linear_fc1_up"})

# model_type -> projection names its decoder layers have (the Llama-style naming shared by these families).
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "qwen2_moe",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3_text",
        "olmo2",
        "granite",
    }
)


def unknown_targets(targets: list[str]) -> list[str]:
    known = set(MEGATRON_TO_HF) | set(HF_TO_MEGATRON) | {ALL_LINEAR}
    return [t for t in targets if t not in known]


def hf_targets(targets: list[str]) -> list[str]:
    """HF module names (peft `target_modules`) for the recipe's targets, in a stable order."""
    if ALL_LINEAR in targets:
        return list(HF_TO_MEGATRON)
    out: list[str] = []
    for t in targets:
        for name in MEGATRON_TO_HF.get(t, (t,)):
            if name not in out:
                out.append(name)
    return out


def megatron_targets(targets: list[str], lora_type: str) -> list[str]:
    """Megatron-Bridge target names; canonical_lora uses the split q/k/v and gate/up names."""
    table = HF_TO_CANONICAL if lora_type == "canonical_lora" else HF_TO_MEGATRON
    out: list[str] = []
    for name in hf_targets(targets):
        mapped = table[name]
        if mapped not in out:
            out.append(mapped)
    return out


# Routed experts stored as stacked 3D parameters (transformers 5's MoE layers, e.g. Qwen3MoeExperts): no nn.Linear per
# expert for a target name to match, so peft needs the parameters named (`target_parameters`). gate and up are one
# fused tensor there, so they are adapted together.
EXPERT_PARAMETERS: dict[str, str] = {
    "gate_proj": "mlp.experts.gate_up_proj",
    "up_proj": "mlp.experts.gate_up_proj",
    "down_proj": "mlp.experts.down_proj",
}


def hf_expert_parameters(targets: list[str]) -> list[str]:
    """peft `target_parameters` for the routed experts of an MoE model, from the recipe's targets."""
    out: list[str] = []
    for name in hf_targets(targets):
        param = EXPERT_PARAMETERS.get(name)
        if param is not None and param not in out:
            out.append(param)
    return out
