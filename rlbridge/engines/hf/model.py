"""The hf engine's model, built once: the transformers model in the recipe's dtype on its device, float32 logits
on a 16-bit one, attention masks without fully masked query rows, peft's LoRA / DoRA adapter, whole-layer
recompute.

HFTrainEngine (engine.py) builds its model with these in this order and never changes its structure again.
"""

from __future__ import annotations

import logging
import types
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlbridge.engines.float32_head import float32_product
from rlbridge.engines.hf import moe as hf_moe
from rlbridge.engines.hf.master import LOW_PRECISION
from rlbridge.errors import RlbridgeError
from rlbridge.model.hf import (
    ALL_ATTENTION_FUNCTIONS,
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    LoraConfig,
    PeftModel,
    PreTrainedModel,
    get_peft_model,
    sdpa_mask,
)
from rlbridge.recipe.schema import Recipe
from rlbridge.recipe.targets import hf_expert_parameters, hf_targets

log = logging.getLogger(__name__)

ADAPTER = "default"
"""peft's adapter name inside the live model (it never appears in exported names)."""
SELF_ATTENDING_SDPA = "rlbridge_sdpa"
"""The attention implementation `attend_to_self` gives an sdpa model: transformers' sdpa attention with the masks of
`self_attending_sdpa_mask`."""
SELF_ATTENDING_MATH_SDPA = "rlbridge_sdpa_math"
"""The same on PyTorch's math SDPA kernel: what a 16-bit model on a CPU gets (`math_sdpa_attention`)."""


def load_model(recipe: Recipe, model_dir: Path, device: torch.device) -> PreTrainedModel:
    """The checkpoint's causal LM in model.dtype on `device`; a 16-bit one returns float32 logits."""
    base: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, recipe.model.dtype)
    )
    nn.Module.to(base, device)
    attend_to_self(base)
    if base.dtype in LOW_PRECISION:
        float32_logits(base)
    return base


def attend_to_self(model: PreTrainedModel) -> None:
    """Give an sdpa model masks in which no query row is fully masked (`self_attending_sdpa_mask`: such a row may
    attend to its own key), for every forward it runs: training passes, log-prob passes (the reference ones
    included), shared-prompt passes with their cache, recorded CUDA-graph passes, and the critic's. Models on
    another attention implementation are left as they are (eager masks with the dtype's finite minimum, so a fully
    masked row gets a finite uniform softmax; flash attention drops padded queries).

    Why: a left-padding column (or any column whose key and every earlier one are padding) is a query row that may
    attend to no key. Such rows are a known source of NaN in attention backwards (a softmax over no key: pytorch
    issues 110213 and 41508), and a NaN at a padded position would reach dQ/dK/dV there and from them every
    projection weight's gradient (the loss's zero gradient at padding does not cancel it: 0 * NaN = NaN), so the step
    would be skipped as non-finite although its loss is finite. Whether a kernel does it depends on the kernel and
    the PyTorch version (tests/gpu/test_gpu_masked_rows.py records it); with these masks no kernel meets such a row.
    transformers 4 unmasked these rows for sdpa (AttentionMaskConverter._unmask_unattended); transformers 5's sdpa
    masks do not.

    A 16-bit model on a CPU (where the model is when this is called) gets the same masks on PyTorch's math SDPA
    kernel (`math_sdpa_attention`)."""
    if model.config._attn_implementation != "sdpa":
        return
    math_kernel = model.device.type == "cpu" and model.dtype in LOW_PRECISION
    name = SELF_ATTENDING_MATH_SDPA if math_kernel else SELF_ATTENDING_SDPA
    AttentionInterface.register(name, math_sdpa_attention if math_kernel else ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(name, self_attending_sdpa_mask)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # a model transformers cannot switch
        log.warning(
            "%s keeps plain sdpa attention masks: on a GPU a padded batch's gradients may come out NaN (steps skipped)",
            type(model).__name__,
        )


def math_sdpa_attention(*args: Any, **kwargs: Any) -> Any:
    """transformers' sdpa attention on PyTorch's math kernel (matmul, softmax, matmul, differentiated by autograd).

    For 16-bit models on a CPU: there the default choice, the CPU flash-attention kernel, computes its backward in
    bfloat16 several times slower than in float32 (it dominated a bfloat16 update of the CPU quickstart's shape,
    slower than the float32 one), while the math kernel's matmuls run at the CPU's 16-bit speed
    (docs/defaults.md#bfloat16-on-a-cpu). The backward follows the kernel the forward chose, so the context is
    needed around the forward only."""
    with sdpa_kernel(SDPBackend.MATH):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def self_attending_sdpa_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0, **kwargs: Any
) -> Tensor | None:
    """transformers' sdpa mask (causal, sliding window, padding, whatever the model asks for) in which a query row
    that may attend to no key may attend to its own: query q_offset + i to key kv_offset + j where
    i + q_offset == j + kv_offset. Every other row is unchanged: real positions (they attend to themselves already)
    and padded ones that see an earlier real token (right padding). Such a padded position's output is never read by
    a real position (its key is masked for them) and its gradient from the loss is zero, so log-probs, losses and
    gradients of real tokens are exactly those of the plain mask. None (sdpa's is_causal path, taken without
    padding) stays None: there every row sees itself. Static shapes and no host synchronization: CUDA graphs
    record it."""
    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        **kwargs,
    )
    if mask is None:
        return None
    queries = torch.arange(q_length, device=mask.device) + q_offset
    keys = torch.arange(kv_length, device=mask.device) + kv_offset
    empty = ~mask.any(dim=-1, keepdim=True)  # [b, 1, q, 1]: rows with no allowed key
    return mask | (empty & (queries[:, None] == keys[None, :]))


def float32_logits(model: PreTrainedModel) -> None:
    """Make a 16-bit model's output layer return float32 logits: its model-dtype input and weight are upcast
    and the product is accumulated and returned in float32, never rounded to bfloat16. Logits of real LMs are
    large (SmolLM2's sampled tokens: 16-39, where a bf16 unit in the last place is 0.125), so rounding them
    alone moves log p by 0.02 on average; vLLM's `head_dtype=float32` computes the same product. Parameter
    names, tying and gradients are unchanged (the casts are differentiable). On a GPU the product runs on TF32
    tensor cores, exact for these 16-bit operands (engines/float32_head)."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise RlbridgeError(f"float32 logits need a plain nn.Linear output layer, got {type(head).__name__}")
    # bound to the module, so that a deepcopy (the full fine-tuning reference) computes with its own weight
    head.forward = types.MethodType(_float32_linear, head)  # type: ignore[method-assign]  # patches the output head's forward on purpose (float32 logits)


def _float32_linear(self: nn.Linear, hidden: Tensor) -> Tensor:
    bias = None if self.bias is None else self.bias.float()
    return float32_product(_upcast_linear, hidden, self.weight, bias)


def _upcast_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return nn.functional.linear(hidden.float(), weight.float(), bias)


def apply_lora(base: PreTrainedModel, recipe: Recipe) -> PeftModel:
    """peft's LoRA / DoRA on the recipe's targets, initialised from run.seed (the global RNG untouched)."""
    cfg = recipe.lora
    # routed experts stored as stacked 3D parameters get their LoRA through target_parameters (hf/moe.py)
    experts = hf_moe.expert_parameters_present(base, hf_expert_parameters(cfg.targets))
    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # annotated int; peft divides it by r as a float
        lora_dropout=cfg.dropout,
        target_modules=hf_targets(cfg.targets),
        target_parameters=experts or None,
        use_dora=cfg.type == "dora",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):  # adapter init from run.seed, global RNG untouched
        torch.manual_seed(recipe.run.seed)
        # lora.compute_dtype float32: float32 adapters on a bfloat16 / float16 base (peft's default): their own
        # master weights, their share of each layer's output computed in float32. model: adapters in the base's
        # dtype (peft creates them so without the autocast), float32 masters from engines/hf/master.py
        return get_peft_model(
            base, config, adapter_name=ADAPTER, autocast_adapter_dtype=cfg.compute_dtype == "float32"
        )


def apply_recompute(hf_model: PreTrainedModel, recipe: Recipe, device: torch.device) -> None:
    """trainer.recompute: whole decoder layers recomputed (non-reentrant checkpointing), with a warning for what
    the hf engine ignores (called from HFTrainEngine.__init__: the warnings name its caller)."""
    recompute = recipe.trainer.recompute
    if recompute.granularity == "none":
        return
    if recompute.granularity == "selective":
        warnings.warn(
            "trainer.recompute.granularity=selective: the hf engine has no attention-only recompute; "
            "it recomputes whole decoder layers (as for full)",
            stacklevel=3,
        )
    if recompute.method is not None or recompute.num_layers is not None:
        warnings.warn(
            "trainer.recompute.method/num_layers are ignored by the hf engine (every layer is recomputed)",
            stacklevel=3,
        )
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Non-reentrant checkpointing (torch's recommendation) propagates gradients to adapters inside a
    # recomputed layer by itself; the recompute-input fix (the embedding output requires grad) is kept in
    # force anyway, as reentrant checkpointing needs it. transformers 5 registers that hook inside
    # gradient_checkpointing_enable; register it here if a version does not.
    if recipe.lora.enabled and not input_grads_enabled(hf_model, device):
        hf_model.enable_input_require_grads()


def input_grads_enabled(hf_model: PreTrainedModel, device: torch.device) -> bool:
    """Whether the embedding output requires grad with a frozen embedding (the recompute-input fix)."""
    embed = hf_model.get_input_embeddings()
    with torch.enable_grad():
        return bool(embed(torch.zeros(1, 1, dtype=torch.long, device=device)).requires_grad)
