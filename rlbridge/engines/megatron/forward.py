"""SeqBatch -> megatron-core's pipeline schedule -> per-token log-probs and entropies of the responses.

What this module simplifies: the engine's two passes (log-probs without gradients, and the training pass)
are the same walk through megatron-core's `get_forward_backward_func` schedule, which works for every
layout (no pipeline, 1F1B, interleaved virtual pipeline). Four details matter:

* the attention mask is explicit (causal AND key-is-real-token), because megatron's default causal mask is
  built on CUDA and knows nothing of left padding;
* RoPE in megatron-core uses positions 0..S-1 of the padded row, not `SeqBatch.position_ids`. Rotary
  attention scores depend only on q - k distances and pad keys are masked, so the result equals the
  HF computation with positions counted from the first real token (checked in the tests). For the same
  reason a micro-batch trimmed to its rows' widths (`split_micro_batches(by_length=True)`: the left padding
  common to its rows dropped) scores as it did at the batch's width (tests/megatron/test_megatron_padding_free);
* the output layer runs on the positions that predict response tokens only (`response_head`, as the hf engine's
  `logits_to_keep`), not on the prompt's;
* log-softmax runs over the tensor-parallel vocab shard with megatron's TP reductions, so the full
  [b, t, vocab] logits are never gathered. (megatron's fused `vocab_parallel_cross_entropy` is not used:
  it overwrites float32 logits in place, which rules out also computing the entropy from them.)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlbridge.batch import SeqBatch, pad_columns
from rlbridge.engines.float32_head import float32_product
from rlbridge.engines.micro import micro_batch_rows


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    """[m, S] tokens (S may include right padding added for sequence parallelism)."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    """[m, 1, S, S] bool, True where attention is NOT allowed (megatron's convention)."""
    rows: torch.Tensor
    """[n] indices of the real rows in the batch handed to the engine (n <= m: see pad_rows)."""
    prompt_width: int
    response_width: int
    routed_experts: torch.Tensor | None = None
    """[m, S, MoE layers, k]: the rollout's experts to replay (rollout.routing_replay), else None."""


def attention_mask(valid_bs: torch.Tensor) -> torch.Tensor:
    """[b, S] 0/1 -> [b, 1, S, S] bool: mask future keys and padding keys."""
    seq = valid_bs.shape[1]
    future = torch.ones(seq, seq, dtype=torch.bool, device=valid_bs.device).triu(diagonal=1)
    return future[None, None] | ~valid_bs.bool()[:, None, None, :]


def split_micro_batches(
    batch: SeqBatch,
    num: int,
    *,
    seq_multiple: int = 1,
    equal_rows: bool = False,
    count_multiple: int = 1,
    by_length: bool = False,
    max_tokens: int | None = None,
) -> list[MicroBatch]:
    """`num` row groups whose sizes differ by at most one (torch.tensor_split, as the hf engine).

    `by_length` (the engine's choice without pipeline or context parallelism): rows sorted by their real
    lengths before the cut and each group trimmed to its own widths (engines/micro.py), so no pass computes
    on columns that are padding in all its rows; each MicroBatch then carries its own prompt/response
    widths. With `max_tokens` too (trainer.max_tokens_per_micro_batch), as many groups as that token budget
    needs (engines/micro.py budget_rows) instead of `num`. Without by_length (pipeline parallelism: every
    stage-to-stage send has one fixed shape) the groups are cut in index order at the whole batch's width and
    `max_tokens` is ignored.

    With `equal_rows` (pipeline parallelism) a shorter group is padded by repeating a row; `MicroBatch.rows`
    lists the real rows only and the stage closures drop the extra outputs. The number of groups is topped
    up to a multiple of `count_multiple` (the interleaved schedule wants whole rounds of one micro-batch per
    pipeline stage) with filler groups without real rows. The sequence is right-padded (masked) to a
    multiple of `seq_multiple` for sequence parallelism, after any trimming.
    """
    if not 1 <= num <= batch.size:
        raise ValueError(f"num_micro_batches must be in [1, {batch.size}], got {num}")
    if by_length:
        if equal_rows or count_multiple > 1:
            raise ValueError("length-grouped micro-batches vary in shape: not for pipeline parallelism")
        return [
            _micro_batch(batch.select(rows).trimmed(), rows, torch.arange(len(rows)), seq_multiple)
            for rows in micro_batch_rows(batch, num, max_tokens=max_tokens, width_multiple=seq_multiple)
        ]
    groups = list(torch.arange(batch.size).tensor_split(num))
    groups += [torch.zeros(0, dtype=torch.long)] * ((-num) % count_multiple)
    width = max(len(g) for g in groups)
    out = []
    for rows in groups:
        take = rows
        if (equal_rows or not len(rows)) and len(rows) < width:
            take = torch.cat([rows, torch.zeros(width - len(rows), dtype=torch.long)])
        out.append(_micro_batch(batch, rows, take, seq_multiple))
    return out


def _micro_batch(batch: SeqBatch, rows: torch.Tensor, take: torch.Tensor, seq_multiple: int) -> MicroBatch:
    """Rows `take` of `batch` (at its widths) as one micro-batch for the batch rows `rows`, the sequence
    right-padded (masked) to a multiple of `seq_multiple`."""
    ids, valid, pos, routed = batch.input_ids, batch.attention_mask, batch.position_ids, batch.routed_experts
    ids, valid, pos = ids[take], valid[take], pos[take]
    routed = None if routed is None else routed[take]
    extra = (-ids.shape[1]) % seq_multiple
    if extra:
        ids = torch.nn.functional.pad(ids, (0, extra))
        valid = torch.nn.functional.pad(valid, (0, extra))
        pos = torch.nn.functional.pad(pos, (0, extra))
        if routed is not None:  # padded columns route like the last one (masked, never scored)
            routed = torch.cat([routed, routed[:, -1:].expand(-1, extra, -1, -1)], dim=1)
    return MicroBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=attention_mask(valid),
        rows=rows,
        prompt_width=batch.prompt_width,
        response_width=batch.response_width,
        routed_experts=routed,
    )


def set_routing_replay(chunk: torch.nn.Module, mb: MicroBatch) -> None:
    """Make every MoE router of `chunk` take the micro-batch's replayed experts in its next forward (megatron-core's
    RouterReplay, built when moe_enable_routing_replay is on), or its own top k when the micro-batch has none.
    A router sees its tokens as [S, m] flattened (sequence-major); layer l of the model is MoE layer l (the models
    rlbridge replays for, Qwen3-MoE, have experts in every layer)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.utils import unwrap_model

    routed = mb.routed_experts
    for layer in unwrap_model(chunk).decoder.layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, MoELayer):
            continue
        replay = mlp.router.router_replay
        if replay is None:
            if routed is None:
                continue
            raise RuntimeError("routing replay: the model was built without moe_enable_routing_replay")
        if routed is None:
            replay.router_replay_action = None
            replay.target_topk_idx = None
            continue
        number = int(layer.layer_number) - 1
        if number >= routed.shape[2]:
            raise ValueError(
                f"routing replay: experts for {routed.shape[2]} MoE layers, layer {number} is MoE"
            )
        replay.target_topk_idx = routed[:, :, number].transpose(0, 1).reshape(-1, routed.shape[-1]).long()
        replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD


# ------------------------------------------------------------------------------ vocab-parallel math
def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` and entropies from logits sharded over the TP vocab: [b, t, v/tp] -> [b, t].

    Differentiable; the full vocabulary is never materialized on one rank. Columns past `vocab_size`
    (megatron's vocab padding) are excluded. `entropy_grad` False: the entropy is a metric (as the hf engine's at
    algorithm.entropy_coef 0), computed without autograd: its vocabulary-wide product neither records a backward
    nor keeps `shifted` alive for one.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    logits = logits.float()
    v_local = logits.shape[-1]
    tp_rank = ps.get_tensor_model_parallel_rank()
    start = tp_rank * v_local
    pad_cols = None
    if start + v_local > vocab_size:  # padded vocabulary columns never win
        pad_cols = torch.arange(start, start + v_local, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad_cols, float("-inf"))
    with torch.no_grad():
        max_bt = logits.max(dim=-1).values
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(max_bt, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - max_bt.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = tp_sum(exp.sum(dim=-1))
    local = targets - start
    in_shard = (local >= 0) & (local < v_local)
    picked = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = tp_sum(torch.where(in_shard, picked, torch.zeros_like(picked)))
    log_z = sum_exp.log()
    logprobs = target_logit - log_z
    if not with_entropy:
        return logprobs, None
    # E_p[shifted] as a batched [1, v] @ [v, 1] product: no [b, t, v] temporary for exp * shifted (the vocabulary
    # dimension dominates memory: 11 GiB per such tensor for 18k response positions of a 152k vocabulary);
    # padded columns (-inf, probability 0) count as 0, the rest of `shifted` is finite
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        values = shifted if pad_cols is None else shifted.masked_fill(pad_cols, 0.0)
        expected = (exp.unsqueeze(-2) @ values.unsqueeze(-1)).reshape(exp.shape[:-1])
        entropy = log_z - tp_sum(expected) / sum_exp
    return logprobs, entropy


def response_logits(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits that predict the response tokens ([n, R, v/tp]) and those tokens ([n, R]), real rows only.
    `output` is the model's [m, S, v/tp] logits, or [m, R, v/tp] where the output layer ran on those positions
    only (`response_head`; S = P + R > R, so the widths tell them apart)."""
    p, r, n = mb.prompt_width, mb.response_width, len(mb.rows)
    targets = mb.input_ids[:n, p : p + r]
    if output.shape[1] == r:
        return output[:n], targets
    return output[:n, p - 1 : p + r - 1], targets


def response_head(model: list[torch.nn.Module], on: bool = True) -> int:
    """Make the output layer (on the last pipeline stage) compute logits only at the positions that predict
    response tokens, as the hf engine's `logits_to_keep`: megatron's GPTModel otherwise multiplies every position
    by the [vocab, hidden] weight in float32 and keeps a transposed copy, 2 x 4 bytes x positions x vocabulary
    (tens of GiB for a 152k vocabulary and a 32k-token pass: docs/defaults.md#plan-memory), and the prompt's share of it is
    never used. A forward pre-hook cuts the layer's input ([S, m, h]) to the window `head_window` gives for
    the micro-batch; the gradient is unchanged (prompt-position logits never enter the loss). Left as it is under
    sequence parallelism or context parallelism (the layer's input is then a shard of the sequence). `on=False`
    turns it back off (the tests' reference). Returns the layers changed."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    if ps.get_context_parallel_world_size() > 1:
        return 0
    changed = 0
    for chunk in unwrap_model(model):
        layer = getattr(chunk, "output_layer", None)
        if layer is None or getattr(layer, "sequence_parallel", False):
            continue
        if not hasattr(layer, "rlbridge_window"):
            layer.register_forward_pre_hook(_cut_to_window, with_kwargs=True)
        layer.rlbridge_window = None
        layer.rlbridge_response_only = on
        changed += 1
    return changed


def _cut_to_window(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    window = getattr(module, "rlbridge_window", None)
    if window is None:
        return None
    start, stop = window
    if args:
        return (args[0][start:stop], *args[1:]), kwargs
    # ColumnParallelLinear.forward(input_, ...) called with the input by keyword
    return args, {**kwargs, "input_": kwargs["input_"][start:stop]}


@contextlib.contextmanager
def head_window(chunk: torch.nn.Module, mb: MicroBatch) -> Iterator[None]:
    """For one forward of `chunk`: its output layer (if `response_head` changed it) computes the logits of
    positions P-1 .. P+R-2 only, those that predict the micro-batch's response tokens."""
    from megatron.core.utils import unwrap_model

    layer = getattr(unwrap_model(chunk), "output_layer", None)
    if not getattr(layer, "rlbridge_response_only", False):
        yield
        return
    assert layer is not None
    layer.rlbridge_window = (mb.prompt_width - 1, mb.prompt_width + mb.response_width - 1)
    try:
        yield
    finally:
        layer.rlbridge_window = None


def batch_rows(parts: list[torch.Tensor], mbs: list[MicroBatch], size: int, width: int) -> torch.Tensor:
    """[size, width] from each micro-batch's [n, r <= width] results (in `mbs` order, real rows only): every
    row back at its batch index, zeros in the columns a trimmed micro-batch dropped (padding in all its rows)."""
    out = parts[0].new_zeros(size, width)
    for part, mb in zip(parts, mbs, strict=True):
        out[mb.rows.to(out.device)] = pad_columns(part, width)
    return out


def float32_output_layer(model: list[torch.nn.Module]) -> int:
    """Make a 16-bit model's output layer (on the last pipeline stage) return float32 logits: its model-dtype
    input and weight shard are upcast and multiplied in float32, never rounded to bfloat16, as the hf engine's
    (engines/hf/model.float32_logits; why: docs/engines/hf.md, "bf16 numerics"). The casts are differentiable, so a
    trained output layer (full fine-tuning) still gets its gradient, through autograd instead of megatron's
    fused accumulation into main_grad (with that fusion on, the layer is left as it is, with a warning). On a GPU
    the product runs on TF32 tensor cores, exact for these 16-bit operands (engines/float32_head).
    Returns the layers changed."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.utils import unwrap_model

    changed = 0
    for chunk in unwrap_model(model):
        layer = getattr(chunk, "output_layer", None)
        if layer is None:
            continue  # not the last pipeline stage
        if not isinstance(layer, ColumnParallelLinear):
            name = type(layer).__name__
            raise TypeError(f"float32 logits need megatron's ColumnParallelLinear output layer, got {name}")
        if layer.gradient_accumulation_fusion:  # it writes the weight's gradient into main_grad itself
            warnings.warn(
                "gradient_accumulation_fusion is on: the output layer keeps model-dtype (rounded) logits",
                stacklevel=2,
            )
            continue
        impl = layer._forward_impl

        def float32_impl(
            input: torch.Tensor, weight: torch.Tensor, *args: Any, _impl: Any = impl, **kwargs: Any
        ) -> Any:
            if kwargs.get("bias") is not None:
                kwargs["bias"] = kwargs["bias"].float()
            upcast = lambda h, w: _impl(h.float(), w.float(), *args, **kwargs)  # noqa: E731
            return float32_product(upcast, input, weight)

        layer._forward_impl = float32_impl  # type: ignore[method-assign]  # patches the output layer's forward on purpose (see the docstring above)
        changed += 1
    return changed


# --------------------------------------------------------------------------------------- schedule
# A per-micro-batch closure on the last pipeline stage: (logits, micro-batch) -> (loss, reduced dict).
StageLoss = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def run_schedule(
    model: list[torch.nn.Module],
    micro_batches: list[MicroBatch],
    stage_loss: StageLoss,
    *,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """One pass of megatron-core's schedule; returns the stage_loss dicts (last pipeline stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator[MicroBatch], chunk: torch.nn.Module) -> Any:
        mb = next(data_iterator)
        set_routing_replay(chunk, mb)
        with head_window(chunk, mb):
            output = chunk(
                input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask
            )
        return output, lambda out: stage_loss(out, mb)

    iterators: Any = [iter(micro_batches) for _ in model] if len(model) > 1 else iter(micro_batches)
    first = micro_batches[0]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(micro_batches),
        seq_length=first.input_ids.shape[1],
        micro_batch_size=first.input_ids.shape[0],
        forward_only=forward_only,
    )


def nominal_scale(passes: int, num_micro_batches: int) -> float:
    """What a pass's loss is multiplied by so that megatron-core's schedule, which divides it by the passes run
    (num_microbatches), backpropagates loss / num_micro_batches as the hf engine does: a token budget changes
    the number of passes, and the loss closures' micro_scale undoes the nominal num_micro_batches only.
    Also keeps the "loss" metric (the passes' mean) the mini-batch loss for any grouping."""
    return passes / num_micro_batches


def broadcast_from_last_stage(value: Any) -> Any:
    """Every pipeline stage gets the last stage's Python object (tensors included)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(
        box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return box[0]


@contextlib.contextmanager
def train_mode(model: list[torch.nn.Module], training: bool) -> Iterator[None]:
    """Every model chunk in train (dropout on) or eval mode for the block, then back as it was."""
    was = [chunk.training for chunk in model]
    for chunk in model:
        chunk.train(training)
    try:
        yield
    finally:
        for chunk, mode in zip(model, was, strict=True):
            chunk.train(mode)


def finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


def zero_grads(model: list[torch.nn.Module], optimizer: Any) -> None:
    """Clear megatron DDP's gradient buffers of every chunk and the optimizer's gradients."""
    for chunk in model:
        chunk.zero_grad_buffer()  # type: ignore[operator]  # DDP chunks have zero_grad_buffer; typed as nn.Module
    optimizer.zero_grad()


def clip_and_step(optimizer: Any, norm: float) -> None:
    """megatron-core's optimizer step after its own prepare_grads / get_grad_norm: clip every (chained)
    sub-optimizer's gradients to its clip_grad with the total norm already computed, then step."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        sub_params = sub.get_parameters()
        if sub.config.clip_grad > 0.0 and sub_params:
            clip_grad_by_total_norm_fp32(sub_params, max_norm=sub.config.clip_grad, total_norm=norm)
    optimizer.step_with_ready_grads()
