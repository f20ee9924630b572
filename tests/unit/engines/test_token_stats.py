"""engines/hf/token_stats.logprobs_and_entropy against autograd's float64 log-softmax and entropy: values and
gradients (log-prob only, entropy only, both), in one chunk and in many (the CPU chunk shrunk to a few rows).
Tolerance: float32 rounding of logits of magnitude ~30 over a 2,000-token vocabulary, 2e-5 absolute on
values and 1e-5 relative to the largest gradient (autograd's own float32 formulas on the same input: 1.5e-4 on
the entropy, 6e-6 relative on the gradient; this function: 7e-6 and 3.5e-6)."""

from __future__ import annotations

import pytest
import torch

from rlbridge.engines.hf import token_stats
from rlbridge.engines.hf.token_stats import logprobs_and_entropy


def _reference(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return logp, -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 3 * 2000 * 4])  # one chunk; chunks of 3 rows (7 of them)
@pytest.mark.parametrize("use", ["logp", "entropy", "both"])
def test_values_and_gradients_match_float64(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, use: str
) -> None:
    monkeypatch.setattr(token_stats, "CPU_CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 5, 2000, generator=gen, dtype=torch.float64) * 6 + 25  # SmolLM2-sized logits
    ids = torch.randint(0, 2000, (4, 5), generator=gen)
    w_logp, w_ent = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)

    def loss(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        terms = {"logp": (logp * w_logp).sum(), "entropy": (ent * w_ent).sum()}
        return terms["logp"] + terms["entropy"] if use == "both" else terms[use]

    want_logits = base.clone().requires_grad_(True)
    want = _reference(want_logits, ids)
    loss(*want).backward()
    got_logits = base.float().requires_grad_(True)
    got = logprobs_and_entropy(got_logits, ids)
    assert got[0].dtype == got[1].dtype == torch.float32
    loss(*got).backward()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.detach(), rtol=0, atol=2e-5)
    assert want_logits.grad is not None and got_logits.grad is not None
    scale = float(want_logits.grad.abs().max())
    torch.testing.assert_close(got_logits.grad.double(), want_logits.grad, rtol=0, atol=1e-5 * scale)


def test_no_gradient_without_a_loss_and_under_no_grad() -> None:
    logits = torch.randn(2, 3, 10, requires_grad=True)
    ids = torch.zeros(2, 3, dtype=torch.long)
    logp, ent = logprobs_and_entropy(logits, ids)
    ent.detach().sum()  # entropy as a metric only: no gradient flows back through it
    logp.sum().backward()
    assert logits.grad is not None
    with torch.no_grad():
        logp, ent = logprobs_and_entropy(logits, ids)
    assert not logp.requires_grad and not ent.requires_grad


def test_rejects_16_bit_logits() -> None:
    with pytest.raises(TypeError, match="float32"):
        logprobs_and_entropy(torch.zeros(1, 1, 4, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.long))
