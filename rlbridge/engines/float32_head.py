"""Float32 logits on tensor cores: the output layer's float32 product of 16-bit operands with CUDA's float32 matmuls
on TF32 tensor cores, for that product only, in the forward and in the backward.

Both engines compute the logits in float32 (the 16-bit hidden states and weight upcast and multiplied in float32,
so that log-probs are not rounded to bfloat16: docs/engines/hf.md, "bf16 numerics"). With CUDA's default float32
matmuls those products run on FFMA kernels, several times slower than tensor cores; at a 7B shape they were 23-24 %
of a LoRA update's kernel time and about half of full fine-tuning's (docs/results.md).

Why TF32 loses nothing in the forward: the operands are bfloat16 / float16 values upcast to float32 (8 / 11
significant bits), which TF32's 11 significant bits hold exactly; each product is then exact in float32 and the
sums are accumulated in float32, so the logits differ from the FFMA kernels' only by the order of summation. In the
backward the logits' gradient (a float32 value) is rounded to 11 significant bits before it is multiplied: at most
2^-10 relative, below the 2^-8 of the bfloat16 rounding the hidden states' gradient gets next.

How it is scoped: the forward runs inside `tf32_matmuls`; two identity autograd nodes around the product switch
TF32 on when the backward reaches the logits and back when it has passed the product's inputs. CUDA's setting is
process-wide, so nothing else runs between them in practice but the product's own backward (and the casts). On a
CPU the setting changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_before: list[str] = []
"""The float32 matmul precision each backward switched from, restored when it has passed the product."""


@contextmanager
def tf32_matmuls() -> Iterator[None]:
    """CUDA float32 matmuls on TF32 tensor cores inside the block; the previous setting after it."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


class _SwitchOn(torch.autograd.Function):
    """Identity on the product's output; its backward (reached before the product's) switches TF32 on."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        matmul = torch.backends.cuda.matmul
        _before.append(matmul.fp32_precision)
        matmul.fp32_precision = "tf32"
        return grad


class _SwitchBack(torch.autograd.Function):
    """Identity on the product's inputs; its backward (reached after the product's) restores the setting."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = tuple(x.view_as(x) for x in inputs)
        # an input without a gradient (a frozen weight) gets none: no weight-gradient product is added
        ctx.mark_non_differentiable(*(o for o, x in zip(outs, inputs, strict=True) if not x.requires_grad))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if _before:
            torch.backends.cuda.matmul.fp32_precision = _before.pop()
        return grads


def float32_product(
    product: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """`product(hidden, weight, *args, **kwargs)` (it upcasts and multiplies in float32) with CUDA float32 matmuls
    on TF32 tensor cores in its forward and its backward (see the module docstring); plain on a CPU."""
    if not hidden.is_cuda:
        return product(hidden, weight, *args, **kwargs)
    return scoped_product(product, hidden, weight, *args, **kwargs)


def scoped_product(
    product: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """float32_product's TF32 scope on any device (a CPU's float32 matmuls ignore the setting: tests use that)."""
    if _before:  # a backward stopped by an error between the two switches left TF32 on: put the setting back
        torch.backends.cuda.matmul.fp32_precision = _before[0]
        _before.clear()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        hidden, weight = _SwitchBack.apply(hidden, weight)
        with tf32_matmuls():
            out = product(hidden, weight, *args, **kwargs)
        return _SwitchOn.apply(out)
    with tf32_matmuls():
        return product(hidden, weight, *args, **kwargs)
