"""bench/trainer_gpu.py's model FLOPs (the numerator of every MFU the project reports) against an independent
count: torch's FlopCounterMode over a real transformers forward + backward of the same shape, full fine-tuning
and peft LoRA on every linear layer.

The counter sees what the kernels compute: eager attention computes the whole S x S score matrix, of which the
formula counts the causal half (the MFU convention); and under LoRA the first layer's q/k/v adapters' A input
gradients, which autograd skips and the formula keeps (2*r*H*T each). With those two terms the counts agree
exactly."""

from __future__ import annotations

import pytest
import torch

from bench.trainer_gpu import SHAPES, model_flops

BATCH, PROMPT, RESPONSE, RANK = 2, 24, 40, 8


def _counted(mode: str) -> tuple[float, int]:
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SHAPES["tiny"])
    archs = cfg.pop("architectures")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.architectures = archs
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    lora_params = 0
    if mode == "lora":
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets)
        )
        lora_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids = torch.randint(0, cfg["vocab_size"], (BATCH, PROMPT + RESPONSE))
    targets = torch.randint(0, cfg["vocab_size"], (BATCH * RESPONSE,))
    with FlopCounterMode(display=False) as counter:
        # the output layer on RESPONSE positions per row, as the engines run it (the loss needs no others)
        logits = model(input_ids=ids, logits_to_keep=RESPONSE).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets).backward()
    return float(counter.get_total_flops()), lora_params


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_formula_equals_counted_flops(mode: str) -> None:
    counted, lora_params = _counted(mode)
    f = model_flops("tiny", mode, BATCH, PROMPT, RESPONSE, lora_params)
    tokens = BATCH * (PROMPT + RESPONSE)
    noncausal_half = 3 * f["attention_fwd_flops"]  # eager attention computes the masked half too
    skipped_adapter_inputs = 3 * 2 * RANK * SHAPES["tiny"]["hidden_size"] * tokens if mode == "lora" else 0
    expected = f["model_flops"] + noncausal_half - skipped_adapter_inputs
    assert counted == pytest.approx(expected, rel=1e-12)
