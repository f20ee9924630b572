"""One forward pass per distinct prompt, not per sample: the hf engine's shared-prompt layout.

GRPO samples `rollout.n` responses per prompt, and a plain forward runs every prompt n times (in the training
forward, its backward and every log-prob pass). Here a pass over rows that share prompts runs in two parts:
1. the distinct prompts once, keeping their attention keys and values (a transformers DynamicCache) and the
   logits of their last position (which predict the first response token);
2. the responses of all rows, each attending to its prompt's keys and values (the cache gathered row by row:
   a differentiable index, so each prompt's gradient is the sum over its responses' passes, as in the plain
   forward) and to its own earlier tokens, at the positions and with the padding mask of the plain forward.
Every response token sees the same inputs as in one forward over [prompt, response], so log-probs, losses and
gradients are equal up to float summation order (tests/unit/engines/test_shared_prompts.py: float32 and float64).

The positions computed per pass drop from rows x (P + R) to prompts x P + rows x R. What is not shared: the
attention of each response token over its prompt's keys (as before), and a second set of kernel launches.
`trainer.shared_prompts: auto` uses this layout on a CPU when it computes fewer positions than the plain one
(`cheaper`); it needs a plain DynamicCache (no sliding-window layers), no activation recompute (transformers
drops the cache of a checkpointed layer) and no routing replay.

On a CPU, where the update is compute-bound, fewer positions make a faster update. On a GPU it was slower (a
host-bound pass becomes two) and its peak memory is higher (the gathered and concatenated keys and values of every
layer are kept for the backward), so auto leaves GPUs on the plain passes
(docs/defaults.md#shared-prompts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from rlbridge.batch import SeqBatch
from rlbridge.engines.micro import length_order, real_lengths
from rlbridge.model.hf import DynamicCache, DynamicLayer

AUTO_DEVICES = ("cpu",)
"""Device types on which trainer.shared_prompts auto may share (module docstring: slower on GPUs)."""
SAVING = 0.8
"""auto shares prompts when the shared layout computes at most this fraction of the plain layout's positions:
the second set of kernel launches and the cache gather cost something, and on a GPU a small pass is bound by
the host, not by positions."""


def prompt_index(batch: SeqBatch) -> tuple[Tensor, Tensor]:
    """(one row of each distinct prompt [u], each row's prompt among them [b]), on the CPU. Prompts are equal
    when their real tokens are (left padding included: same length)."""
    real = batch.attention_mask[:, : batch.prompt_width].cpu() > 0
    key = torch.where(real, batch.input_ids[:, : batch.prompt_width].cpu(), -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), batch.size, dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(batch.size), reduce="amin")
    # number the prompts in order of their first row, so that the layout does not depend on unique's sort
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return first[order], rank[inverse]


def widths(batch: SeqBatch) -> tuple[list[int], list[int]]:
    """Real prompt and response lengths of every row, as lists (micro.real_lengths)."""
    prompt_len, response_len = real_lengths(batch)
    return prompt_len.tolist(), response_len.tolist()


class RowShape(NamedTuple):
    """Each row's distinct prompt (prompt_index's numbering) and its real prompt and response lengths: what
    the layout decision reads, computed once per batch (shape_of) and handed to grouped_rows and cheaper."""

    prompt_of: Tensor
    prompt_len: list[int]
    response_len: list[int]

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_of.max()) + 1


def shape_of(batch: SeqBatch) -> RowShape:
    return RowShape(prompt_index(batch)[1], *widths(batch))


def grouped_rows(
    batch: SeqBatch,
    num_groups: int,
    *,
    max_tokens: int | None = None,
    shape: RowShape | None = None,
    packed: bool = False,
) -> list[Tensor]:
    """Row indices of each pass with rows of one prompt kept together: prompts ordered by their longest
    response (then prompt length), their rows in that order cut into `num_groups` near-equal groups, or by a
    token budget on the shared layout's positions (shared_positions; `packed`: of packed passes).
    `shape`: shape_of(batch), if the caller has it."""
    prompt_of, prompt_len, response_len = shape or shape_of(batch)
    longest: dict[int, int] = {}
    for row, p in enumerate(prompt_of.tolist()):
        longest[p] = max(longest.get(p, 0), response_len[row])
    within = length_order(batch).tolist()  # rows of one prompt by response length
    rank = {row: i for i, row in enumerate(within)}
    rows = sorted(
        range(batch.size),
        key=lambda r: (longest[int(prompt_of[r])], prompt_len[r], int(prompt_of[r]), rank[r]),
    )
    if max_tokens is None:
        return list(torch.tensor(rows, dtype=torch.long).tensor_split(num_groups))
    groups: list[list[int]] = []
    cost = _GroupCost(prompt_of.tolist(), prompt_len, response_len, packed)
    for row in rows:
        if groups and cost.with_row(row) <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
            cost.reset()
        cost.add(row)
    return [torch.tensor(g, dtype=torch.long) for g in groups]


class _GroupCost:
    """shared_positions of a growing group, one row at a time (grouped_rows: O(1) per row, not O(group))."""

    def __init__(
        self, prompt_of: list[int], prompt_len: list[int], response_len: list[int], packed: bool
    ) -> None:
        self.prompt_of, self.prompt_len, self.response_len, self.packed = (
            prompt_of,
            prompt_len,
            response_len,
            packed,
        )
        self.reset()

    def reset(self) -> None:
        self.prompts: set[int] = set()
        self.rows = self.widest_prompt = self.widest_response = self.real = 0

    def _after(self, row: int) -> tuple[int, int, int, int, int]:
        new_prompt = self.prompt_of[row] not in self.prompts
        return (
            len(self.prompts) + new_prompt,
            self.rows + 1,
            max(self.widest_prompt, self.prompt_len[row]),
            max(self.widest_response, self.response_len[row]),
            self.real + self.response_len[row] + (self.prompt_len[row] if new_prompt else 0),
        )

    def with_row(self, row: int) -> int:
        prompts, rows, widest_prompt, widest_response, real = self._after(row)
        return real if self.packed else prompts * widest_prompt + rows * widest_response

    def add(self, row: int) -> None:
        _, self.rows, self.widest_prompt, self.widest_response, self.real = self._after(row)
        self.prompts.add(self.prompt_of[row])


def shared_positions(
    rows: list[int],
    prompt_of: Tensor,
    prompt_len: list[int],
    response_len: list[int],
    *,
    packed: bool = False,
) -> int:
    """Positions one shared pass over `rows` computes: distinct prompts x widest prompt + rows x widest response;
    packed (no padding): the distinct prompts' lengths + the responses' lengths."""
    prompts = {int(prompt_of[r]): r for r in rows}
    if packed:
        return sum(prompt_len[r] for r in prompts.values()) + sum(response_len[r] for r in rows)
    return len(prompts) * max(prompt_len[r] for r in rows) + len(rows) * max(response_len[r] for r in rows)


def plain_positions(
    groups: list[Tensor], prompt_len: list[int], response_len: list[int], *, packed: bool = False
) -> int:
    """Positions the plain passes over `groups` compute: rows x (widest prompt + widest response) per pass;
    packed: every row's real prompt and response lengths."""
    if packed:
        return sum(prompt_len[r] + response_len[r] for g in groups for r in g.tolist())
    return sum(
        len(g) * (max(prompt_len[r] for r in g.tolist()) + max(response_len[r] for r in g.tolist()))
        for g in groups
    )


def cheaper(
    batch: SeqBatch,
    plain: list[Tensor],
    shared: list[Tensor],
    *,
    shape: RowShape | None = None,
    packed: bool = False,
) -> bool:
    """Whether the shared layout's passes compute at most SAVING of the plain layout's positions (`packed`: of
    packed passes, both ways)."""
    prompt_of, prompt_len, response_len = shape or shape_of(batch)
    cost = sum(
        shared_positions(g.tolist(), prompt_of, prompt_len, response_len, packed=packed) for g in shared
    )
    return cost <= SAVING * plain_positions(plain, prompt_len, response_len, packed=packed)


def plain_cache(cache: object) -> bool:
    """Whether a prompt pass returned a cache this module can gather and extend (every layer a DynamicLayer)."""
    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


def shared_response_logits(model: nn.Module, sub: SeqBatch) -> tuple[Tensor, Tensor]:
    """(float32 logits predicting the first response token [b, 1, V], those predicting the others [b, R-1, V])
    of a trimmed forward batch, with each distinct prompt run once (module docstring)."""
    p, r = sub.prompt_width, sub.response_width
    first, prompt_of = prompt_index(sub)
    first, prompt_of = first.to(sub.input_ids.device), prompt_of.to(sub.input_ids.device)
    prompts = model(
        input_ids=sub.input_ids[first, :p],
        attention_mask=sub.attention_mask[first, :p],
        position_ids=sub.position_ids[first, :p],
        use_cache=True,
        logits_to_keep=1,
    )
    head = prompts.logits[prompt_of].float()
    if r == 1:  # the prompt's last position predicts the only response column
        return head, head.new_empty(sub.size, 0, head.shape[-1])
    cache = prompts.past_key_values
    if not plain_cache(cache):
        raise TypeError(f"shared prompts need a DynamicCache of DynamicLayers, got {type(cache).__name__}")
    cache.batch_select_indices(prompt_of)
    out = model(
        input_ids=sub.input_ids[:, p : p + r - 1],
        attention_mask=sub.attention_mask[:, : p + r - 1],
        position_ids=sub.position_ids[:, p : p + r - 1],
        past_key_values=cache,
        use_cache=True,
    )
    return head, out.logits.float()
