"""Float32 master weights for a trainer whose model runs in bfloat16 / float16 (the hf engine and its critic).

What it settles: with a bfloat16 model an AdamW step of lr * update on a bfloat16 weight is rounded back to
bfloat16, and any step smaller than half a unit in the last place (2^-9 relative) is lost: with lr 1e-5 and
weights around 1e-2 that is every step. So each trainable parameter that is not float32 gets a float32
*master* copy; the optimizer (and its moments, created like its parameters) only sees the masters, the
model keeps its own dtype for the forward and backward pass, and after every step the masters are copied
(rounded) into the model.

Gradients: a hook on each low-precision parameter moves its gradient into the master's float32 `.grad` as
soon as autograd has accumulated it (and drops the model's copy), so gradients of several micro-batches are
summed in float32, and clipping, the finite check and the norm all see float32 gradients under the same
names as before.

Parameters that are already float32 (peft's adapters on a bfloat16 base: peft's `autocast_adapter_dtype`
keeps them float32; the critic's value head) are their own master: nothing is copied and nothing changes.

Checkpoints store the masters (float32), so a resumed run continues from exactly the values the optimizer
held, not from their bfloat16 rounding.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """Float32 masters for the low-precision ones among named trainable parameters (see the module docstring)."""

    def __init__(self, trainable: list[tuple[str, nn.Parameter]]) -> None:
        self.named: list[tuple[str, nn.Parameter]] = []
        """(name, master) for every trainable parameter: the optimizer's parameters, in the model's order. A
        float32 parameter is its own master."""
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for name, param in trainable:
            if param.dtype not in LOW_PRECISION:
                self.named.append((name, param))
                continue
            master = nn.Parameter(param.detach().to(torch.float32, copy=True))
            param.register_post_accumulate_grad_hook(partial(_move_grad, master))
            self.named.append((name, master))
            self._pairs.append((param, master))

    @property
    def num_copies(self) -> int:
        """How many parameters have a separate float32 master (0 for a float32 model or bf16 base + LoRA)."""
        return len(self._pairs)

    @torch.no_grad()
    def to_model(self) -> None:
        """Copy the masters into the model's low-precision parameters (round to nearest)."""
        for param, master in self._pairs:
            param.copy_(master)


def _move_grad(master: nn.Parameter, param: Tensor) -> None:
    """Post-accumulate-grad hook: add the model parameter's gradient to its master's float32 gradient."""
    grad = param.grad
    if grad is None:
        return
    param.grad = None
    if master.grad is None:
        master.grad = grad.to(torch.float32)
    else:
        master.grad.add_(grad)
