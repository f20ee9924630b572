"""Core attention for the local (no Transformer Engine) layer spec, on torch's fused SDPA kernels.

megatron-core's local spec uses `DotProductAttention`: baddbmm -> masked softmax -> dropout -> bmm, which
materialises the [b, heads, s, s] scores and probabilities (several copies, the softmax in float32) in every
layer. `SDPAttention` is a drop-in replacement with the same constructor and forward signature (megatron-core
0.16 and 0.19: `CoreAttentionBuilder` / `CoreAttention` in transformer/attention.py) that calls
`torch.nn.functional.scaled_dot_product_attention`, so PyTorch picks a flash / memory-efficient / cuDNN
kernel on CUDA (and its own fused CPU kernel on CPU).

Conventions kept from `DotProductAttention`:

* layout: query [sq, b, np, hn], key/value [sk, b, ng, hn] (ng = query groups per TP rank, GQA when
  ng < np); the output is [sq, b, np * hn];
* `attention_mask` is boolean with True = masked (SDPA's boolean mask is the opposite: True = attend), any
  shape broadcastable to [b, np, sq, sk] ([b, 1, s, s] from rlbridge's forward). With no mask and
  `attn_mask_type` causal, attention is causal;
* softmax scale: `softmax_scale` (config.softmax_scale) or 1/sqrt(hn). `apply_query_key_layer_scaling`
  divides the scores by the layer number before the softmax and multiplies them back inside it (a float16
  range trick), so the effective scale is unchanged and nothing needs doing here;
* dropout on the attention probabilities with `config.attention_dropout` (or the constructor's
  `attention_dropout`) in training mode only, inside the CUDA RNG tracker's fork as megatron does when
  sequence parallelism is off;
* no packed sequences, no attention bias, no context parallelism, vanilla softmax, no sliding window (the
  spec keeps `DotProductAttention` for configurations that need them: `supports`).

Two things differ from a literal translation, both for speed and neither changing a real token's output:

* a mask that is exactly causal (a micro-batch without padding: the common case in benchmarks and in
  packed-free training with equal lengths) is passed as `is_causal=True` with no mask, which lets SDPA use
  the flash kernel (and its native GQA, no repeated K/V). Deciding that needs one comparison on the device
  (a host sync); it is made once per mask tensor and cached, and every layer of a forward pass gets the same
  mask tensor, so it costs one sync per micro-batch;
* a query row whose keys are all masked (a left-padding position: no real key at or before it) attends to
  itself only. `DotProductAttention` gives such a row a uniform average over every key (softmax of equal
  -10000 fills); SDPA would give NaN (or 0, depending on the kernel), and a NaN, even in a position no loss
  reads, would reach the gradients through 0 * NaN. Pad positions are never attended to by real tokens and
  never scored, so the choice cannot change a real token's output or any gradient of the loss.

`RLBRIDGE_MEGATRON_ATTENTION=unfused` makes the local spec keep megatron's `DotProductAttention` (for
comparisons: bench/trainer_gpu.py runs both).
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

ENV = "RLBRIDGE_MEGATRON_ATTENTION"
CHOICES = ("sdpa", "unfused")


def choice() -> str:
    """The attention the local spec uses: `sdpa` (default) or `unfused` (megatron's DotProductAttention)."""
    value = os.environ.get(ENV, "sdpa").strip().lower() or "sdpa"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def supports(config: Any) -> bool:
    """Whether SDPAttention can stand in for DotProductAttention under this TransformerConfig."""
    return (
        getattr(config, "softmax_type", "vanilla") == "vanilla"
        and getattr(config, "window_size", None) is None
        and getattr(config, "context_parallel_size", 1) == 1
        and not getattr(config, "multi_latent_attention", False)
    )


class _MaskCache:
    """The last attention mask seen and what it converts to (every layer of a pass gets the same tensor).

    Holds the mask weakly: the entry is dropped when the forward pass lets go of the mask."""

    def __init__(self) -> None:
        self.ref: weakref.ref[torch.Tensor] | None = None
        self.key: tuple[int, int, int] = (-1, 0, 0)
        self.result: torch.Tensor | None = None
        """None: the mask is exactly causal. Otherwise SDPA's boolean mask (True = attend)."""

    def convert(self, mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor | None:
        key = (_version(mask), sq, sk)
        if self.ref is not None and self.ref() is mask and self.key == key:
            return self.result
        given, mask = mask, mask.bool()
        causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(diagonal=1 + sk - sq)
        if sq == sk and mask.dim() == 4 and torch.equal(mask, causal.expand_as(mask)):
            result = None
        else:
            result = ~mask
            if sq == sk:  # rows with no key to attend to (left padding) attend to themselves
                empty = ~result.any(dim=-1, keepdim=True)
                result = result | (empty & torch.eye(sq, dtype=torch.bool, device=mask.device))
        self.ref = weakref.ref(given, self._dropped)
        self.key, self.result = key, result
        return result

    def _dropped(self, ref: Any) -> None:
        if ref is self.ref:
            self.ref = self.result = None


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference-mode tensors have no version counter
        return -1


_CACHE = _MaskCache()


class SDPAttention(MegatronModule):
    """DotProductAttention's interface on `F.scaled_dot_product_attention` (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if not supports(config):
            raise ValueError(
                "SDPAttention supports vanilla softmax without sliding window or context parallelism only"
            )
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import divide

        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        world = pg_collection.tp.size()
        projection = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection, world)
        self.head_dim = divide(projection, config.num_attention_heads)
        self.heads = divide(config.num_attention_heads, world)
        self.groups = divide(config.num_query_groups, world)
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **unused: Any,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPAttention: packed sequences need Transformer Engine")
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention_bias is not supported")
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attention_mask is not None:
            mask = _CACHE.convert(attention_mask, sq, sk)
            causal = mask is None
        else:
            mask, causal = None, mask_type == AttnMaskType.causal and sq > 1
        # [s, b, h, d] -> [b, h, s, d] (views; SDPA wants the last dimension contiguous only)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        rep = self.heads // self.groups
        gqa = rep > 1 and mask is None and q.is_cuda
        if rep > 1 and not gqa:  # native GQA only on the flash / math CUDA kernels (torch docs)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        fork: Any = contextlib.nullcontext()
        if dropout > 0.0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            fork = tensor_parallel.get_cuda_rng_tracker().fork()
        kwargs = {"enable_gqa": True} if gqa else {}
        with fork:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=causal,
                scale=self.softmax_scale,
                **kwargs,
            )
        # [b, h, sq, d] -> [sq, b, h * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def core_attention_class(config: Any) -> type:
    """The core attention module the local spec should build for this config."""
    if choice() == "sdpa" and supports(config):
        return SDPAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention
