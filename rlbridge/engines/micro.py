"""Which rows share a forward pass, so that no pass computes on columns that are padding for all its rows.

A SeqBatch pads every row to the longest prompt and the longest response of the whole batch; a micro-batch
cut from it in index order keeps that width, so a short row next to a long one pays for the long one, and so
does every micro-batch without one. Here rows are sorted by their real length before they are cut into
groups (same number of groups, sizes differing by at most one, as `tensor_split` gives), and each group is
then trimmed to its own widths (`SeqBatch.trimmed`).

Exactness: the forward of a row does not depend on the other rows of its pass, and the loss closures of
rlbridge.algo.objective return each micro-batch's share of the mini-batch loss (agg(micro) * count(micro) /
count(mini)), which sums to the mini-batch loss for *any* partition of the rows into micro-batches. So the
accumulated gradient is unchanged up to float summation order; what changes are the per-micro-batch metrics
the engine averages (a mean over different groups of rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlbridge.batch import SeqBatch


def length_order(batch: SeqBatch) -> Tensor:
    """[b] row indices sorted by real-token count (stable: ties keep index order), on the CPU."""
    return torch.sort(batch.real_tokens().cpu(), stable=True).indices


def micro_batch_rows(batch: SeqBatch, num_micro_batches: int, *, by_length: bool = True) -> list[Tensor]:
    """Row indices of each micro-batch: `num_micro_batches` groups of near-equal size, of rows of similar
    length (by_length) or contiguous in index order (by_length=False: the former layout)."""
    if not 1 <= num_micro_batches <= batch.size:
        raise ValueError(f"num_micro_batches must be in [1, {batch.size}], got {num_micro_batches}")
    rows = length_order(batch) if by_length else torch.arange(batch.size)
    return list(rows.tensor_split(num_micro_batches))


def chunk_rows(batch: SeqBatch, chunk_size: int, *, by_length: bool = True) -> list[Tensor]:
    """Row indices of forward passes of at most `chunk_size` rows (no-gradient scoring: log-probs, values)."""
    rows = length_order(batch) if by_length else torch.arange(batch.size)
    return list(rows.split(chunk_size))


def forward_batch(batch: SeqBatch, rows: Tensor, device: torch.device, *, trim: bool = True) -> SeqBatch:
    """The rows' sub-batch on `device`, trimmed to its own widths (trim) or at the full batch width."""
    sub = batch.select(rows)
    return (sub.trimmed() if trim else sub).to(device)
