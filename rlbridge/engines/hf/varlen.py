"""Packed passes for the hf engine (trainer.packed_passes): a pass's rows as one row of their real tokens, no
padding, with attention kept inside each row by variable-length attention over the rows' boundaries.

The padded layout (engines/micro.py) computes every row at its pass's widths: rows sorted by length leave ~20 % of
the positions padding on GSM8K-like lengths, and SDPA runs with a padding mask. Here the real tokens of the pass's
rows are concatenated ([1, T]), each row's position ids restart at 0, and the layers' attention is
`VARLEN_ATTENTION`, registered with transformers' attention interface: torch's `varlen_attn` (FlashAttention-2
kernels in torch) with the pass's cumulative row lengths for 16-bit tensors on CUDA, one causal SDPA per row
elsewhere (float32 models, CPUs: exact, for the tests). transformers hands the `cu_seq_lens_*` / `max_length_*` keywords of the model call to the attention
function. The output layer runs on the positions that predict response tokens only (`logits_to_keep` as indices),
and the log-probs and entropies come back in the padded [b, R] layout the loss closures index, 0 on padding.

Exactness: each token attends to the same keys as in the padded forward (its own row's earlier tokens) at the same
positions, so log-probs and gradients equal the padded layout's up to float summation order
(tests/unit/engines/test_packed_passes.py). Not with: sliding-window attention, CUDA graphs (recorded padded
shapes), shared-prompt passes, routing replay (recipe/checks/layout.py refuses those).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlbridge.batch import SeqBatch
from rlbridge.engines.hf.token_stats import logprobs_and_entropy
from rlbridge.errors import RlbridgeError

VARLEN_ATTENTION = "rlbridge_varlen"
"""The attention implementation name registered with transformers for the packed passes."""


def _rows_attention(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scale: float | None) -> Tensor:
    """Causal attention one row at a time with torch's SDPA (any device, differentiable); layout (tokens, heads,
    head_dim); grouped-query attention by repeating K/V per head group."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[start:end].repeat_interleave(groups, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs, dim=0)


def varlen_cuda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    scale: float | None,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
) -> Tensor:
    """torch's varlen_attn (16-bit CUDA tensors, layout (tokens, heads, head_dim)) whatever its torch version
    takes: causal as window (window[0], 0) (or `is_causal` on a torch without window_size, which then has no
    sliding window), GQA by `enable_gqa` (or K/V repeated per head group). Also bench/trl_async.py's stand-in for
    FlashAttention's varlen function."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (window[0], 0) if causal else tuple(window)
    elif window[0] != -1:
        raise NotImplementedError("a sliding window needs torch's varlen_attn with window_size")
    else:
        kw["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **kw)
    return out[0] if isinstance(out, tuple) else out  # (output, aux) only with return_aux


def _attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kw: Any
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: one packed row's [1, heads, T, dim] queries, keys and values
    -> [1, T, heads, dim]."""
    if kw.get("sliding_window"):
        raise RlbridgeError("trainer.packed_passes: sliding-window attention is not supported")
    cu, longest = kw["cu_seq_lens_q"], int(kw["max_length_q"])
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, dim]
    scale = kw.get("scaling")
    on_kernel = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)  # FlashAttention's dtypes
    out = (
        varlen_cuda(q, k, v, cu, cu, longest, longest, scale)
        if on_kernel
        else _rows_attention(q, k, v, cu, scale)
    )
    return out.unsqueeze(0), None


def use_packed_attention(model: nn.Module) -> None:
    """Register VARLEN_ATTENTION with transformers (once per process; no mask is built for it) and make it
    `model`'s attention. Refuses models with sliding-window layers."""
    from rlbridge.model.hf import AttentionInterface, AttentionMaskInterface, flash_attention_mask

    config = getattr(model, "config", None)
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types or (
        getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
    ):
        raise RlbridgeError(
            "trainer.packed_passes: this model has sliding-window attention layers, which the packed passes do "
            "not implement; set trainer.packed_passes: false"
        )
    AttentionInterface.register(VARLEN_ATTENTION, _attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, flash_attention_mask)  # None without a padding mask
    model.set_attn_implementation(VARLEN_ATTENTION)  # type: ignore[operator]  # a PreTrainedModel, typed nn.Module
    if model.config._attn_implementation != VARLEN_ATTENTION:  # type: ignore[union-attr]  # as above
        raise RlbridgeError(
            f"trainer.packed_passes: transformers cannot switch {type(model).__name__}'s attention to the packed "
            "passes' varlen attention; set trainer.packed_passes: false"
        )


def packed_token_stats(model: nn.Module, sub: SeqBatch) -> tuple[Tensor, Tensor]:
    """[b, R] log-probs and entropies of a forward batch's response tokens (0 on padding) from one packed forward
    of its rows' real tokens (the model's attention VARLEN_ATTENTION: use_packed_attention)."""
    real = (
        sub.attention_mask > 0
    )  # [b, S]: a row's real columns are contiguous (prompt left-padded, response right)
    lengths = real.sum(dim=1)
    cu = F.pad(lengths.cumsum(0), (1, 0))
    packed_index = real.cumsum(dim=1) - 1 + cu[:-1, None]  # [b, S] each real column's index in the packed row
    p = sub.prompt_width
    response = real[:, p:]  # real response columns, those the log-probs are for
    picks = packed_index[:, p:][response] - 1  # the position before each response token predicts it
    longest = int(lengths.max())  # one host sync
    out = model(
        input_ids=sub.input_ids[real][None],
        position_ids=sub.position_ids[real][None],
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
        use_cache=False,
        logits_to_keep=picks,
    )
    logits = out.logits.float()  # [1, n, V]
    logp, entropy = logprobs_and_entropy(logits, sub.input_ids[:, p:][response][None])
    zeros = torch.zeros(response.shape, dtype=logp.dtype, device=logp.device)
    return zeros.masked_scatter(response, logp[0]), zeros.masked_scatter(response, entropy[0])
