"""Log-probs and entropies of response tokens from float32 logits, in one pass per chunk of positions.

`logprobs_and_entropy(logits [b, R, V], ids [b, R]) -> (log p(id) [b, R], entropy [b, R])` computes what
`logit[id] - logsumexp(logits)` and `logsumexp(z) - sum(softmax(z) * z)` compute, with a hand-written
backward: d log p(id) / dz = onehot(id) - p and d H / dz = p * (E_p[z] - z). Autograd's version of the same
two formulas walks the [positions, vocab] logits 10-15 times and allocates several [positions, vocab]
temporaries (the log-sum-exp's, the gather's zero-filled gradient, their sum); this one reads a chunk of
rows while it is in cache (each step a handful of vector ops on it) and writes the logits' gradient once.
With a large vocabulary on a CPU those vocabulary-wide passes are a large share of the update
(docs/defaults.md#vllm-on-the-cpu).

Exact up to float32 rounding order (tests/unit/engines/test_token_stats.py compares values and gradients with
autograd's float64 result). Entropy's gradient is computed only where the loss uses it (entropy_coef > 0).

`response_logits` runs the model for those logits (the output layer on the response positions only);
`token_logprobs` and `token_entropy` are the same two formulas through autograd, the references tests and
benchmarks compare against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rlbridge.batch import SeqBatch

# bytes of float32 logits per chunk: a few rows that stay in a CPU core's cache; on a GPU, large enough that
# the per-chunk kernel launches do not matter, small enough that the chunk's temporaries are a rounding error
CPU_CHUNK_BYTES = 1 << 21
GPU_CHUNK_BYTES = 1 << 28


def logprobs_and_entropy(logits_brv: Tensor, ids_br: Tensor) -> tuple[Tensor, Tensor]:
    """float32 [b, R] log-probs of `ids_br` and entropies under float32 `logits_brv`; both differentiable."""
    b, r, v = logits_brv.shape
    flat = logits_brv.reshape(b * r, v)
    logp, entropy = _TokenStats.apply(flat, ids_br.reshape(b * r))
    return logp.reshape(b, r), entropy.reshape(b, r)


def _chunk_rows(logits: Tensor) -> int:
    budget = GPU_CHUNK_BYTES if logits.is_cuda else CPU_CHUNK_BYTES
    return max(1, budget // max(1, logits.shape[1] * logits.element_size()))


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]  # torch declares *args
        if logits.dtype != torch.float32:
            raise TypeError(f"token statistics need float32 logits, got {logits.dtype}")
        n = logits.shape[0]
        lse, expected = logits.new_empty(n), logits.new_empty(n)
        picked = logits.gather(1, ids.unsqueeze(1)).squeeze(1)
        step = _chunk_rows(logits)
        for start in range(0, n, step):
            z = logits[start : start + step]
            top = z.amax(dim=1, keepdim=True)
            e = torch.sub(z, top).exp_()  # the chunk's one temporary
            total = e.sum(dim=1)
            # E_p[z] = sum(e * z) / sum(e), with the product written into e (sum_i e_i z_i: a row-wise dot)
            expected[start : start + step] = e.mul_(z).sum(dim=1).div_(total)
            lse[start : start + step] = total.log_().add_(top.squeeze(1))
        ctx.save_for_backward(logits, ids, lse, expected)
        ctx.set_materialize_grads(False)
        return picked - lse, lse - expected

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, None]:  # type: ignore[override]  # torch declares *grad_outputs
        logits, ids, lse, expected = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None
        grad = torch.empty_like(logits)
        step = _chunk_rows(logits)
        for start in range(0, logits.shape[0], step):
            stop = start + step
            z, out = logits[start:stop], grad[start:stop]
            torch.sub(z, lse[start:stop].unsqueeze(1), out=out).exp_()  # p
            if g_ent is None:  # -g * p (g_logp is set: one of the two is)
                assert g_logp is not None
                out.mul_(-g_logp[start:stop].unsqueeze(1))
            else:  # p * (g_ent * (E[z] - z) - g_logp)
                scale = torch.sub(expected[start:stop].unsqueeze(1), z).mul_(g_ent[start:stop].unsqueeze(1))
                if g_logp is not None:
                    scale.sub_(g_logp[start:stop].unsqueeze(1))
                out.mul_(scale)
        if g_logp is not None:
            grad.scatter_add_(1, ids.unsqueeze(1), g_logp.unsqueeze(1))
        return grad, None


def response_logits(model: nn.Module, batch: SeqBatch) -> Tensor:
    """[b, R, V] float32 logits that predict the response tokens: positions P-1 .. P+R-2. The output layer
    only runs on the last R + 1 positions (the very last one is dropped)."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=batch.response_width + 1,
    )
    return out.logits[:, :-1].float()


def token_logprobs(logits_brv: Tensor, ids_br: Tensor) -> Tensor:
    """log softmax(logits)[id] as `logit[id] - logsumexp(logits)`: no [b, R, V] log-softmax tensor."""
    picked = logits_brv.gather(-1, ids_br.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits_brv, dim=-1)


def token_entropy(logits_brv: Tensor) -> Tensor:
    """Entropy `logsumexp(z) - sum(softmax(z) * z)` with one [b, R, V] temporary (the probabilities); the
    product-sum is a batched matmul, so no second one."""
    probs = torch.softmax(logits_brv, dim=-1)
    expected = (probs.unsqueeze(-2) @ logits_brv.unsqueeze(-1)).reshape(probs.shape[:-1])
    return torch.logsumexp(logits_brv, dim=-1) - expected
