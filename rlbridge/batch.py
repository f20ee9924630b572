"""The two data types that cross the trainer/rollout boundary, and the loss closures the algorithm hands the trainer.

`Rollouts` is what a rollout engine returns (plain lists: it crosses Ray and process boundaries cheaply).
`SeqBatch` is what a trainer engine consumes: prompts left-padded to a common width P and responses
right-padded to a common width R, so the response of every row starts at column P and the log-prob of
response token j is read from the logits at column P + j - 1 for all rows at once (no per-row gather).
Log-probs, advantages and masks over responses are therefore all [b, R] tensors aligned column by column.
`LossFn` and `ValueLossFn` are the closures over those tensors that algo/objective.py makes and every trainer
engine calls per micro-batch (engines/base.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Rollouts:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    """Log-probs of the sampled tokens under the rollout engine's weights (same length as response_ids)."""
    finish_reasons: list[str]
    """'stop' (EOS or stop string) or 'length' (hit max_response_tokens)."""
    weight_version: int
    """The weight version the engine generated with."""
    texts: list[str] = field(default_factory=list)
    """Decoded responses."""
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    """rollout.routing_replay only (else empty): per sample, [prompt + response positions, MoE layers, k] int16,
    the experts the rollout engine routed each position to (a position it never ran, such as the last token,
    holds its own arbitrary experts: no scored log-prob depends on it)."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON content (a checkpoint's in-flight rollouts): routed experts as nested lists."""
        out = asdict(self)
        out["routed_experts"] = [t.tolist() for t in self.routed_experts]
        return out

    @classmethod
    def from_json(cls, content: dict[str, Any]) -> Rollouts:
        routed = [torch.tensor(t, dtype=torch.int16) for t in content.get("routed_experts", [])]
        return cls(**{**content, "routed_experts": routed})


@dataclass
class SeqBatch:
    input_ids: torch.Tensor
    """[b, P + R] prompt (left-padded) followed by response (right-padded)."""
    attention_mask: torch.Tensor
    """[b, P + R] 1 on real tokens."""
    position_ids: torch.Tensor
    """[b, P + R] positions counted from the first real token of each row."""
    response_mask: torch.Tensor
    """[b, R] float, 1 on real response tokens."""
    prompt_width: int
    """P: the column where every response starts."""
    routed_experts: torch.Tensor | None = None
    """[b, P + R, MoE layers, k] integer: the rollout's experts per column, for the trainer's forwards to replay
    (rollout.routing_replay; pad columns arbitrary). None: the trainer routes itself."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def response_ids(self) -> torch.Tensor:
        """[b, R] response token ids (pad where response_mask is 0)."""
        return self.input_ids[:, self.prompt_width :]

    def select(self, index: slice | torch.Tensor | list[int]) -> SeqBatch:
        return SeqBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            position_ids=self.position_ids[index],
            response_mask=self.response_mask[index],
            prompt_width=self.prompt_width,
            routed_experts=None if self.routed_experts is None else self.routed_experts[index],
        )

    def trimmed(self) -> SeqBatch:
        """The same rows without the columns that are padding (attention_mask 0) in every row: prompt columns on
        the left, response columns on the right; one prompt and one response column are always kept. Real
        tokens keep their ids, positions and attention: no real token attends a left padding column (masked) or
        a right one (it comes later: causal), so every real position's output is unchanged up to float summation
        order, and the dropped response columns held padding only. Callers bring per-token results back to the
        original R with `pad_columns`."""
        real = self.attention_mask > 0
        p, r = self.prompt_width, self.response_width
        prompt_cols = real[:, :p].any(dim=0)
        start = int(prompt_cols.int().argmax()) if bool(prompt_cols.any()) else p
        start = min(start, max(p - 1, 0))
        response_cols = real[:, p:].any(dim=0) | (self.response_mask > 0).any(dim=0)
        last = int(response_cols.nonzero().max()) + 1 if bool(response_cols.any()) else 0
        end = p + max(last, min(r, 1))
        if start == 0 and end == p + r:
            return self
        return SeqBatch(
            input_ids=self.input_ids[:, start:end],
            attention_mask=self.attention_mask[:, start:end],
            position_ids=self.position_ids[:, start:end],
            response_mask=self.response_mask[:, : end - p],
            prompt_width=p - start,
            routed_experts=None if self.routed_experts is None else self.routed_experts[:, start:end],
        )

    def width_rounded(self, multiple: int) -> SeqBatch:
        """The same rows with masked columns added on the left of the prompts so that P + R is a multiple of
        `multiple` (itself when it already is, or multiple <= 1): id 0, attention_mask 0, position 0, as the
        left padding of `from_token_lists`. Exact as `trimmed` is: no real token attends a masked column, and
        the response columns (R, the response mask) are unchanged, so per-token results keep their shape; the
        pass costs up to multiple - 1 more positions per row. Its use: few distinct pass shapes
        (trainer.pass_width_multiple)."""
        extra = (-self.input_ids.shape[1]) % multiple if multiple > 1 else 0
        return _left_columns(self, extra) if extra else self

    def sides_rounded(self, multiple: int) -> SeqBatch:
        """The same rows with masked columns added on the left of the prompts and on the right of the responses so
        that P and R are each a multiple of `multiple` (itself when they are, or multiple <= 1): the pass shapes
        of trainer.cuda_graphs, which record one graph per (rows, P, R). Left columns as in `width_rounded`;
        right ones: id 0, attention_mask 0, the row's last position, response_mask 0, as the right padding of
        `from_token_lists`. Exact as `trimmed` is (no real token attends a later column); per-token results have
        the rounded R: callers cut them back to their own width."""
        if multiple <= 1:
            return self
        left, right = (-self.prompt_width) % multiple, (-self.response_width) % multiple
        out = _left_columns(self, left) if left else self
        return _right_columns(out, right) if right else out

    def to(self, device: Any) -> SeqBatch:
        return SeqBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.position_ids.to(device),
            self.response_mask.to(device),
            self.prompt_width,
            None if self.routed_experts is None else self.routed_experts.to(device),
        )

    @classmethod
    def from_token_lists(
        cls,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        pad_id: int,
        routed_experts: list[torch.Tensor] | None = None,
    ) -> SeqBatch:
        """`routed_experts`: per row [positions, layers, k] as in Rollouts (empty or None: no replay)."""
        if len(prompt_ids) != len(response_ids) or not prompt_ids:
            raise ValueError("need one response per prompt and at least one row")
        width_p = max(len(p) for p in prompt_ids)
        width_r = max(1, max(len(r) for r in response_ids))
        b = len(prompt_ids)
        ids = torch.full((b, width_p + width_r), pad_id, dtype=torch.long)
        mask = torch.zeros((b, width_p + width_r), dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            ids[i, width_p - len(p) : width_p] = torch.tensor(p, dtype=torch.long)
            mask[i, width_p - len(p) : width_p] = 1
            if r:
                ids[i, width_p : width_p + len(r)] = torch.tensor(r, dtype=torch.long)
                mask[i, width_p : width_p + len(r)] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        routed = (
            _routed_columns(prompt_ids, response_ids, routed_experts, width_p, width_r)
            if routed_experts
            else None
        )
        return cls(ids, mask, positions, mask[:, width_p:].to(torch.float32), width_p, routed)


def _left_columns(batch: SeqBatch, extra: int) -> SeqBatch:
    """`extra` masked columns before the prompts (SeqBatch.width_rounded)."""

    def left(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.new_zeros((x.shape[0], extra, *x.shape[2:])), x], dim=1)

    routed = batch.routed_experts
    if routed is not None:  # masked columns route like the first one (never scored)
        routed = torch.cat([routed[:, :1].expand(-1, extra, *routed.shape[2:]), routed], dim=1)
    return SeqBatch(
        input_ids=left(batch.input_ids),
        attention_mask=left(batch.attention_mask),
        position_ids=left(batch.position_ids),
        response_mask=batch.response_mask,
        prompt_width=batch.prompt_width + extra,
        routed_experts=routed,
    )


def _right_columns(batch: SeqBatch, extra: int) -> SeqBatch:
    """`extra` masked columns after the responses (SeqBatch.sides_rounded)."""

    def right(x: torch.Tensor, last: bool = False) -> torch.Tensor:
        tail = (
            x[:, -1:].expand(-1, extra, *x.shape[2:])
            if last
            else x.new_zeros((x.shape[0], extra, *x.shape[2:]))
        )
        return torch.cat([x, tail], dim=1)

    routed = batch.routed_experts
    return SeqBatch(
        input_ids=right(batch.input_ids),
        attention_mask=right(batch.attention_mask),
        position_ids=right(batch.position_ids, last=True),
        response_mask=right(batch.response_mask),
        prompt_width=batch.prompt_width,
        routed_experts=None if routed is None else right(routed, last=True),
    )


def _routed_columns(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    rows: list[torch.Tensor],
    width_p: int,
    width_r: int,
) -> torch.Tensor:
    """Per-row routed experts [positions, layers, k] -> [b, P + R, layers, k] aligned with the batch's columns;
    pad columns repeat expert numbers 0..k-1 (never scored)."""
    layers, k = rows[0].shape[1:]
    out = torch.arange(k, dtype=torch.int16).expand(len(rows), width_p + width_r, layers, k).clone()
    for i, (p, r, routed) in enumerate(zip(prompt_ids, response_ids, rows, strict=True)):
        n = len(p) + len(r)
        if routed.shape[0] < n:
            raise ValueError(f"row {i}: routed experts for {routed.shape[0]} positions, the sample has {n}")
        out[i, width_p - len(p) : width_p + len(r)] = routed[:n].to(torch.int16)
    return out


def pad_columns(x_bt: torch.Tensor, width: int) -> torch.Tensor:
    """[b, width] from [b, t <= width]: zeros appended on the right (differentiable); `x_bt` itself when
    t == width. Brings per-token results of a `SeqBatch.trimmed` batch back to the untrimmed response width."""
    missing = width - int(x_bt.shape[1])
    if missing < 0:
        raise ValueError(f"cannot pad {int(x_bt.shape[1])} columns down to {width}")
    return torch.nn.functional.pad(x_bt, (0, missing)) if missing else x_bt


def pad_lists(rows: list[list[float]], width: int, value: float = 0.0) -> torch.Tensor:
    """[b, width] float32 tensor from ragged rows (the rollout's log-probs, aligned with SeqBatch)."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row[:width], dtype=torch.float32)
    return out


# loss_fn(logprobs_bt, entropy_bt, rows) -> (scalar loss, metrics). `rows` are the indices of the micro-batch
# inside the batch passed to train_step (any subset in any order: the hf engine groups rows by length), so the
# closure can slice advantages / old log-probs itself; the tensors it gets are [len(rows), R] at the batch's R.
# Every engine backpropagates loss_fn(...) / num_micro_batches for each micro-batch.
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]

# value_loss_fn(values_bt, rows) -> (scalar loss, metrics), the critic's LossFn (rows: as for LossFn).
ValueLossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
