"""The recipe's `model` and `lora` sections: which weights are trained, and whether through adapters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlbridge.recipe.schema.base import Section

Dtype = Literal["float32", "bfloat16", "float16"]


class ModelCfg(Section):
    path: str
    """Local Hugging Face model directory (config.json, safetensors, tokenizer), a short name that rlbridge
    materializes into its cache (`smollm2-135m-instruct`, `gemma3-270m`: docs/models.md), or a Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`)
    found in the Hugging Face cache (HF_HOME) or, when online, downloaded by `train` (HF_HUB_OFFLINE=1: the cache
    only; fetch with `hf download ORG/NAME`). An existing local path wins over a Hub id of the same spelling."""
    revision: str | None = None
    """Branch, tag or commit of a Hub id (default: main). Only for Hub ids."""
    dtype: Dtype = "bfloat16"
    """Parameter dtype for training and rollout. bfloat16 halves the memory and is the GPU choice; float32 gives
    tight trainer/rollout agreement (and is the CPU quickstart's choice), at twice the memory."""


class LoraCfg(Section):
    rank: Annotated[int, Field(ge=0)] = 0
    """LoRA rank. 0 means full fine-tuning (no adapters). Raise it when a LoRA run learns too little for its
    task; each step of rank adds trainable parameters, optimizer state and adapter-sync bytes (docs/lora.md)."""
    alpha: Annotated[float, Field(gt=0)] = 32.0
    """LoRA scaling numerator: the update is (alpha / rank) * B @ A."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the LoRA input. RL post-training usually keeps it at 0: it makes the trainer's log-probs differ
    from the rollout's."""
    targets: list[str] = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    """Modules that get adapters. Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2, linear_q,
    linear_k, linear_v, linear_fc1_gate, linear_fc1_up) or HF names (q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj), or `all-linear`. Mapped per engine."""
    type: Literal["lora", "dora", "canonical_lora"] = "lora"
    """Adapter type. canonical_lora puts separate adapters on q, k, v and gate, up (as HF PEFT does)."""
    compute_dtype: Literal["float32", "model"] = "float32"
    """hf engine on a bfloat16 / float16 model: the dtype its adapters are held and computed in. float32 (peft's
    default): the adapters are their own float32 master weights and each adapted layer computes its LoRA share in
    float32 (its input cast to float32 and the sum cast back: casts and float32 products, a third of a 7B LoRA
    step's time in a profile, docs/engines/hf.md). model: adapters in the model's dtype with float32 master copies
    for the optimizer (as the megatron engine keeps them): 16-bit tensor-core products, no casts or float32 input
    copies (faster, less memory: docs/engines/hf.md); the LoRA share is rounded to the model's dtype before it is
    added (tests/unit/engines/test_hf_bf16.py states the log-prob gap). Not with trainer.cuda_graphs (its replays
    cannot move gradients into the masters). A float32 model, and the megatron engine (always the model's dtype),
    are unaffected."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0
