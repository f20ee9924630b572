"""The output layer's float32 product on TF32 tensor cores (engines/float32_head) against CUDA's exact float32 matmuls,
at the 7B shape's output layer (hidden 3584, vocab 152064, bfloat16 operands, 1024 positions):

- logits: TF32's are the exact float32 products summed in another order: max |difference| <= 2e-5 of the largest
  |logit| (9.7e-6 measured on an H100, 2026-12-07: the bound leaves 2x for another card's kernels); the log-probs of
  fixed targets within 1e-4 (3.6e-5 measured);
- the hidden states' gradient (bfloat16): within two bfloat16 units of its largest value; the weight's (full
  fine-tuning, float32 after the cast back to bfloat16): the same;
- CUDA's float32 matmul setting is the previous one after the forward and after the backward.

Figures: the differences, and the seconds of one forward + backward each way (a figure, not a gate).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from rlbridge.engines.float32_head import float32_product
from tests.gpu.common import DRY_RUN, figure

HIDDEN, VOCAB, POSITIONS = (3584, 152064, 1024) if not DRY_RUN else (64, 512, 32)


def upcast_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(hidden.float(), weight.float())


def forward_backward(tf32: bool, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> dict:
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    sync = torch.cuda.synchronize if h.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    logits = float32_product(upcast_linear, h, w) if tf32 else upcast_linear(h, w)
    logp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    after_forward = torch.backends.cuda.matmul.fp32_precision
    (-logp.mean()).backward()
    sync()
    return {"logits": logits.detach(), "logp": logp.detach(), "gh": h.grad, "gw": w.grad,
            "s": time.perf_counter() - start, "after_forward": after_forward}  # fmt: skip


def test_tf32_output_layer_matches_exact_float32() -> None:
    device = "cpu" if DRY_RUN else "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(POSITIONS, HIDDEN, generator=g, device=device).to(torch.bfloat16)
    weight = (0.02 * torch.randn(VOCAB, HIDDEN, generator=g, device=device)).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (POSITIONS,), generator=g, device=device)
    before = torch.backends.cuda.matmul.fp32_precision
    runs = {}
    for tf32 in (False, True, False, True):  # the second of each is timed warm
        runs[tf32] = forward_backward(tf32, hidden, weight, targets)
    exact, tc = runs[False], runs[True]
    assert tc["after_forward"] == before and torch.backends.cuda.matmul.fp32_precision == before

    logit_gap = float((tc["logits"] - exact["logits"]).abs().max() / exact["logits"].abs().max())
    logp_gap = float((tc["logp"] - exact["logp"]).abs().max())
    bf16_unit = 2.0**-7  # two units in the last place of a bfloat16 value, relative to the largest
    gh_gap = float((tc["gh"].float() - exact["gh"].float()).abs().max() / exact["gh"].float().abs().max())
    gw_gap = float((tc["gw"].float() - exact["gw"].float()).abs().max() / exact["gw"].float().abs().max())
    figure("float32_head_tf32", logit_gap=logit_gap, logp_gap=logp_gap, grad_hidden_gap=gh_gap,
           grad_weight_gap=gw_gap, exact_s=exact["s"], tf32_s=tc["s"], shape=[POSITIONS, HIDDEN, VOCAB])  # fmt: skip
    assert logit_gap <= 2e-5 and logp_gap <= 1e-4, (logit_gap, logp_gap)
    assert gh_gap <= bf16_unit and gw_gap <= bf16_unit, (gh_gap, gw_gap)
