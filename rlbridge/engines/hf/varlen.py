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
shapes), routing replay (recipe/checks/layout.py refuses those).

Shared prompts (trainer.shared_prompts, shared_layout): each distinct prompt's tokens once per pass; every row's
response is a segment whose queries are its tokens and whose keys and values are its prompt's and its own,
gathered from the packed row by index (KV_INDEX), causal aligned to the segment's last key. The gather is
differentiable, so a prompt's gradient sums over its responses, as in the padded forward.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlbridge.batch import SeqBatch
from rlbridge.engines.hf.token_stats import logprobs_and_entropy
from rlbridge.errors import RlbridgeError
from rlbridge.model.info import sliding_window_layers

VARLEN_ATTENTION = "rlbridge_varlen"
"""The attention implementation name registered with transformers for the packed passes."""
KV_INDEX = "rlbridge_kv_index"
"""The model-call keyword (handed to the attention function) of the packed tokens whose keys and values each
segment attends to, in segment order, under shared prompts."""


def _rows_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float | None
) -> Tensor:
    """Causal attention one segment at a time with torch's SDPA (any device, differentiable); layout (tokens, heads,
    head_dim); a segment's queries are its last keys (bottom-right causal alignment, as FlashAttention's); grouped-query
    attention by repeating K/V per head group."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    q_spans = _spans(cu_q)
    k_spans = q_spans if cu_k is cu_q else _spans(cu_k)  # one host read where queries and keys share bounds
    for (q0, q1), (k0, k1) in zip(q_spans, k_spans, strict=True):
        qs = q[q0:q1].transpose(0, 1)
        ks = k[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
        n, m = q1 - q0, k1 - k0
        if n == 0:
            continue
        mask = None if n == m else torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        outs.append(
            F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale
            ).transpose(0, 1)
        )
    return torch.cat(outs, dim=0)


def _spans(cu: Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


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
    -> [1, T, heads, dim]. With KV_INDEX among the keywords (shared prompts), the keys and values of segment s are
    the packed tokens KV_INDEX[cu_seq_lens_k[s]:cu_seq_lens_k[s + 1]] (a response's: its prompt's, then its own)."""
    if kw.get("sliding_window"):
        raise RlbridgeError("trainer.packed_passes: sliding-window attention is not supported")
    cu_q, cu_k = kw["cu_seq_lens_q"], kw["cu_seq_lens_k"]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, dim]
    gather = kw.get(KV_INDEX)
    if gather is not None:
        # differentiable: a prompt's gradient sums over its responses' segments. index_select's backward is one
        # index_add (k[gather]'s, an accumulating index_put, sorts the indices first: several kernels a layer)
        k, v = k.index_select(0, gather), v.index_select(0, gather)
    scale = kw.get("scaling")
    on_kernel = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)  # FlashAttention's dtypes
    out = (
        varlen_cuda(q, k, v, cu_q, cu_k, int(kw["max_length_q"]), int(kw["max_length_k"]), scale)
        if on_kernel
        else _rows_attention(q, k, v, cu_q, cu_k, scale)
    )
    return out.unsqueeze(0), None


def use_packed_attention(model: nn.Module) -> None:
    """Register VARLEN_ATTENTION with transformers (once per process; no mask is built for it) and make it
    `model`'s attention. Refuses models with sliding-window layers."""
    from rlbridge.model.hf import AttentionInterface, AttentionMaskInterface, flash_attention_mask

    pretrained: Any = model  # a transformers PreTrainedModel
    config = pretrained.config.to_dict()
    sliding = sliding_window_layers(config, int(config.get("num_hidden_layers") or 0))
    if sliding:  # validate-recipe refuses these first (recipe/checks/model.py, check_packed_passes_model)
        raise RlbridgeError(
            f"trainer.packed_passes: this model has {sliding} sliding-window attention layers, which the packed "
            "passes do not implement; set trainer.packed_passes: false"
        )
    AttentionInterface.register(VARLEN_ATTENTION, _attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, flash_attention_mask)  # None without a padding mask
    model.set_attn_implementation(VARLEN_ATTENTION)  # type: ignore[operator]  # a PreTrainedModel, typed nn.Module
    if model.config._attn_implementation != VARLEN_ATTENTION:  # type: ignore[union-attr]  # as above
        raise RlbridgeError(
            f"trainer.packed_passes: transformers cannot switch {type(model).__name__}'s attention to the packed "
            "passes' varlen attention; set trainer.packed_passes: false"
        )


def packed_token_stats(model: nn.Module, sub: SeqBatch, *, shared: bool = False) -> tuple[Tensor, Tensor]:
    """[b, R] log-probs and entropies of a forward batch's response tokens (0 on padding) from one packed forward
    of its rows' real tokens (the model's attention VARLEN_ATTENTION: use_packed_attention). shared: each
    distinct prompt's tokens once (shared_layout), else every row's prompt and response as one segment."""
    real = (
        sub.attention_mask > 0
    )  # [b, S]: a row's real columns are contiguous (prompt left-padded, response right)
    p = sub.prompt_width
    response = real[:, p:]  # real response columns, those the log-probs are for
    if shared:
        layout = shared_layout(sub)
        ids, positions, picks = layout.input_ids, layout.position_ids, layout.picks
        keywords: dict[str, Any] = {KV_INDEX: layout.kv_index}
        cu_q, cu_k, longest_q, longest_k = layout.cu_q, layout.cu_k, layout.longest_q, layout.longest_k
    else:
        lengths = real.sum(dim=1)
        cu_q = cu_k = F.pad(lengths.cumsum(0), (1, 0))
        # [b, S] each real column's index in the packed row
        packed_index = real.cumsum(dim=1) - 1 + cu_q[:-1, None]
        picks = packed_index[:, p:][response] - 1  # the position before each response token predicts it
        longest_q = longest_k = int(lengths.max())  # one host sync
        ids, positions, keywords = sub.input_ids[real], sub.position_ids[real], {}
    out = model(
        input_ids=ids[None],
        position_ids=positions[None],
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=longest_q,
        max_length_k=longest_k,
        use_cache=False,
        logits_to_keep=picks,
        **keywords,
    )
    logits = out.logits.float()  # [1, n, V]
    logp, entropy = logprobs_and_entropy(logits, sub.input_ids[:, p:][response][None])
    zeros = torch.zeros(response.shape, dtype=logp.dtype, device=logp.device)
    return zeros.masked_scatter(response, logp[0]), zeros.masked_scatter(response, entropy[0])


class SharedLayout(NamedTuple):
    """One packed row with each distinct prompt once: its tokens (the distinct prompts' real tokens, then every
    row's real response tokens, rows in order), and the attention segments: one per distinct prompt (causal over
    itself), one per row (its response tokens as queries; its prompt's tokens and its own as keys, kv_index into
    the packed tokens). picks: the packed position predicting each real response token, row-major (a row's first
    response token is predicted by its prompt's last token, shared by the prompt's rows)."""

    input_ids: Tensor
    position_ids: Tensor
    kv_index: Tensor
    cu_q: Tensor
    cu_k: Tensor
    longest_q: int
    longest_k: int
    picks: Tensor


def shared_layout(sub: SeqBatch) -> SharedLayout:
    """SharedLayout of a forward batch (rows with equal prompts share one copy: shared_prompts.prompt_index);
    the index arithmetic runs on the host, the indices go to the batch's device once."""
    from rlbridge.engines.hf.shared_prompts import prompt_index

    p, device = sub.prompt_width, sub.input_ids.device
    first, prompt_of = prompt_index(sub)
    real = sub.attention_mask.cpu() > 0
    prompt_len = real[first, :p].sum(dim=1)  # [u]
    response_len = real[:, p:].sum(dim=1)  # [b]
    prompt_start = F.pad(prompt_len.cumsum(0), (1, 0))[:-1]  # [u] in the packed row
    response_start = int(prompt_len.sum()) + F.pad(response_len.cumsum(0), (1, 0))[:-1]  # [b]
    row_prompt_len, row_prompt_start = prompt_len[prompt_of], prompt_start[prompt_of]
    # keys: each prompt's own tokens, then per row its prompt's tokens followed by its response's
    starts = torch.cat([prompt_start, torch.stack([row_prompt_start, response_start], dim=1).flatten()])
    counts = torch.cat([prompt_len, torch.stack([row_prompt_len, response_len], dim=1).flatten()])
    q_len = torch.cat([prompt_len, response_len])
    k_len = torch.cat([prompt_len, row_prompt_len + response_len])
    # each real response token's packed index, row-major; its predictor is the token before, or for a row's first
    # response token the last token of its prompt
    tokens = _ranges(response_start, response_len)
    first_token = F.pad(response_len.cumsum(0), (1, 0))[:-1][response_len > 0]
    picks = tokens - 1
    picks[first_token] = (row_prompt_start + row_prompt_len - 1)[response_len > 0]
    prompt_real, response_real = real[first, :p].to(device), real[:, p:].to(device)
    first_on = first.to(device)
    return SharedLayout(
        input_ids=torch.cat([sub.input_ids[first_on, :p][prompt_real], sub.input_ids[:, p:][response_real]]),
        position_ids=torch.cat(
            [sub.position_ids[first_on, :p][prompt_real], sub.position_ids[:, p:][response_real]]
        ),
        kv_index=_ranges(starts, counts).to(device),
        cu_q=F.pad(q_len.cumsum(0), (1, 0)).to(device),
        cu_k=F.pad(k_len.cumsum(0), (1, 0)).to(device),
        longest_q=int(q_len.max()),
        longest_k=int(k_len.max()),
        picks=picks.to(device),
    )


def _ranges(starts: Tensor, counts: Tensor) -> Tensor:
    """The concatenation of arange(start, start + count) over the pairs (1-D int64 tensors)."""
    offsets = F.pad(counts.cumsum(0), (1, 0))[:-1]
    return torch.repeat_interleave(starts - offsets, counts) + torch.arange(int(counts.sum()))
