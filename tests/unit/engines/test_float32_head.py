"""engines/float32_head: the output layer's float32 product with CUDA float32 matmuls on TF32 for that product only.

On a CPU the setting does not change a CPU matmul, so these tests run the scope itself (`scoped_product`) and watch
the setting: TF32 while the product's forward and backward run, the previous setting before and after, the same
values and gradients as the plain product, and no gradient product for a frozen weight. The premise of the module
(bfloat16 values are exact in TF32) is checked by rounding to TF32's 10 stored mantissa bits.
"""

from __future__ import annotations

import torch
from torch import nn

from rlbridge.engines.float32_head import scoped_product, tf32_matmuls

MATMUL = torch.backends.cuda.matmul


class Recorder:
    """A float32 product (upcasts and F.linear) that records the setting seen in its forward and backward."""

    def __init__(self) -> None:
        self.forward: list[str] = []
        self.backward: list[str] = []

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.forward.append(MATMUL.fp32_precision)
        h = hidden.float()
        if h.requires_grad:
            h.register_hook(lambda g: self.backward.append(MATMUL.fp32_precision))
        return nn.functional.linear(h, weight.float())


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded toward zero to TF32 (10 stored mantissa bits of float32's 23)."""
    return (x.float().view(torch.int32) & ~((1 << 13) - 1)).view(torch.float32)


def test_the_scope_is_tf32_in_forward_and_backward_and_restored_after() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 16, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(40, 16, generator=g).to(torch.bfloat16).requires_grad_()
    before = MATMUL.fp32_precision
    rec = Recorder()
    out = scoped_product(rec, hidden, weight)
    assert MATMUL.fp32_precision == before and rec.forward == ["tf32"]
    out.logsumexp(-1).sum().backward()
    assert rec.backward == ["tf32"] and MATMUL.fp32_precision == before
    got = (out.detach(), hidden.grad, weight.grad)

    hidden.grad = weight.grad = None
    plain = nn.functional.linear(hidden.float(), weight.float())
    plain.logsumexp(-1).sum().backward()
    assert out.dtype == torch.float32 and torch.equal(got[0], plain.detach())
    assert got[1] is not None and got[2] is not None and hidden.grad is not None and weight.grad is not None
    assert torch.equal(got[1], hidden.grad) and torch.equal(got[2], weight.grad)


def test_a_frozen_weight_gets_no_gradient_and_no_grad_passes_stay_plain() -> None:
    hidden = torch.randn(4, 16).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(40, 16).to(torch.bfloat16)  # frozen: LoRA's output layer
    seen: list[bool] = []

    def product(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(w.requires_grad)
        return nn.functional.linear(h.float(), w.float())

    scoped_product(product, hidden, weight).sum().backward()
    assert seen == [False] and weight.grad is None and hidden.grad is not None
    before = MATMUL.fp32_precision
    rec = Recorder()
    with torch.no_grad():
        scoped_product(rec, hidden, weight)
    assert rec.forward == ["tf32"] and MATMUL.fp32_precision == before


def test_tf32_matmuls_restores_the_setting_on_error() -> None:
    before = MATMUL.fp32_precision
    try:
        with tf32_matmuls():
            assert MATMUL.fp32_precision == "tf32"
            raise ValueError
    except ValueError:
        pass
    assert MATMUL.fp32_precision == before


def test_16_bit_values_are_exact_in_tf32_and_float32_gradients_are_not() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=g) * 30
    for dtype in (torch.bfloat16, torch.float16):
        v = x.to(dtype).float()
        assert torch.equal(tf32_round(v), v), dtype  # the forward's operands: unrounded on TF32 tensor cores
    rel = ((tf32_round(x) - x).abs() / x.abs()).max()
    assert 0 < rel <= 2**-10  # a float32 gradient loses at most 2^-10 (truncated; 2^-11 rounded to nearest)


def test_a_backward_stopped_by_an_error_does_not_leave_tf32_on() -> None:
    before = MATMUL.fp32_precision
    hidden = torch.randn(4, 16).requires_grad_()
    weight = torch.randn(40, 16)

    def out_of_memory(grad: torch.Tensor) -> None:
        raise RuntimeError("out of memory in the backward")

    def failing(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        up = h.float()
        up.register_hook(out_of_memory)
        return nn.functional.linear(up, w.float())

    out = scoped_product(failing, hidden, weight)
    try:
        out.sum().backward()
    except RuntimeError:
        pass
    assert MATMUL.fp32_precision == "tf32"  # stopped between the switches
    scoped_product(Recorder(), hidden, weight)  # the next product puts the setting back first
    assert MATMUL.fp32_precision == before
