"""CUDA graphs of the hf engine's training passes (trainer.cuda_graphs): one launch per pass instead of ~39k.

Why: at small passes the update is host-bound. The GPU quickstart's step trains 32 rows of <= 176 columns in one
pass; its forward and backward through peft's LoRA layers are ~39k aten calls, far more host time than GPU work.
A CUDA graph replays the recorded kernels without the Python, the dispatcher or the launches, several times faster
(docs/defaults.md#cuda-graphs).

How, per pass shape (rows, prompt width, response width, whether the entropy gets a gradient; the engine rounds
both widths up to trainer.pass_width_multiple, SeqBatch.sides_rounded, so a run meets few shapes):
- the first pass of a shape runs eagerly on the engine's side stream (the warm-up a capture needs: cuBLAS and
  cuDNN plans, workspaces, the allocator's blocks) and is then recorded as two graphs in one memory pool shared
  by all shapes: the forward from the static inputs (ids, attention mask, positions) to the response tokens'
  log-probs and entropies (`stats`: the engine's own function), and the backward from their gradients to every
  trainable parameter's gradient (torch.autograd.grad over the forward's autograd graph);
- before the first step the trainer records the shapes the training prompts make likely the same way, from
  placeholder batches of those shapes (`prerecord`, `likely_widths`, `shape_batch`; TrainerRole.prerecord);
- every later pass of that shape copies its inputs into the static ones, replays the forward, and hands the loss
  closure (run eagerly, as ever: it is the algorithm's, and cheap) the log-probs through an autograd Function
  whose backward copies the closure's gradients in, replays the backward graph and adds the parameters'
  gradients into `.grad` (summed over the passes of a step, as eager accumulation does).

Exact: a replay runs the kernels the capture recorded on the same shapes, so a graphed pass computes what the
eager pass of that shape computes (tests/gpu/test_gpu_cuda_graphs.py: bitwise equal, float32 and bfloat16,
over 8 optimizer steps).
Graphs read every parameter at its address: AdamW updates the trainable ones in place, which the replays see;
a parameter whose storage moved (data_ptr changed, e.g. a load that swapped `.data`) drops every graph, which
are then recorded again. A capture that fails (a host synchronization inside the forward, an unsupported
kernel) turns the graphs off for the run with one warning; the passes run eagerly as before.

Memory: all shapes record into one memory pool. What a shape keeps for itself is what outlives its recording:
its static inputs, outputs and parameter gradients (4 bytes per trainable parameter: 18 MB for SmolLM2 with LoRA
r16). Its forward's saved activations are freed at the end of its backward's recording, so the next shape's
recording reuses that memory: every shape's graphs write and read the same blocks, which is safe because a pass
replays its forward and its backward before any other pass replays anything (one pass at a time, in order). So the
pool holds about one pass's activations, next to the allocator's own for the eager passes: `rlbridge plan` counts
one more pass (of at most MAX_PASS_TOKENS positions) and MAX_GRAPHS sets of gradients (plan/memory_estimate.py). Only passes of at
most MAX_PASS_TOKENS positions are recorded (larger ones are compute-bound: a graph buys little there), and at
most MAX_GRAPHS shapes are kept (the least recently used one is dropped).
"""

from __future__ import annotations

import gc
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlbridge.batch import SeqBatch
from rlbridge.recipe.schema import MAX_GRAPHS, MAX_PASS_TOKENS

log = logging.getLogger(__name__)


Key = tuple[int, int, int, bool]
Stats = Callable[[SeqBatch], tuple[Tensor, Tensor]]

PRERECORD_MAX = MAX_GRAPHS // 2
"""The most pass shapes recorded before the first step (PassGraphs.prerecord); the rest of MAX_GRAPHS is left for
shapes the run meets that the prompt lengths did not foresee."""
PRERECORD_FLOOR = 0.01
"""A prompt width is recorded ahead when at least this share of steps is expected to meet it (likely_widths)."""


def likely_widths(
    prompt_lengths: list[int], *, prompts_per_step: int, max_response: int, multiple: int
) -> list[tuple[int, int]]:
    """The (prompt width, response width) pairs of the passes a run's steps are likely to meet, most likely first:
    a step's pass is as wide as its longest prompt and its longest response, each rounded up to `multiple`
    (SeqBatch.sides_rounded). Prompts are drawn uniformly, so a step of B prompts meets prompt width w with
    probability F(w)^B - F(w - multiple)^B, F the share of prompts of width <= w; widths below PRERECORD_FLOOR are
    left out. Responses may end anywhere up to max_response: every multiple, the longest first (early steps sample
    to the limit)."""
    if not prompt_lengths or prompts_per_step < 1 or max_response < 1 or multiple < 1:
        return []
    counts = Counter(math.ceil(max(n, 1) / multiple) * multiple for n in prompt_lengths)
    total, below, chance = len(prompt_lengths), 0, {}
    for width in sorted(counts):
        share = (below + counts[width]) / total
        chance[width] = share**prompts_per_step - (below / total) ** prompts_per_step
        below += counts[width]
    prompts = sorted((w for w, p in chance.items() if p >= PRERECORD_FLOOR), key=lambda w: (-chance[w], w))
    responses = range(math.ceil(max_response / multiple) * multiple, 0, -multiple)
    return [(p, r) for r in responses for p in prompts]


def shape_batch(rows: int, prompt_width: int, response_width: int, vocab: int) -> SeqBatch:
    """A batch of `rows` rows whose pass has the given widths (PassGraphs.prerecord): token ids are placeholders, and
    one row's prompt and another's response are a token short, so that the mask pads on both sides as real batches'
    do (an unpadded batch takes attention's unmasked path in the eager warm-up)."""
    ids = torch.arange(rows * (prompt_width + response_width)).remainder(vocab).view(rows, -1).tolist()
    prompts = [row[:prompt_width] for row in ids]
    responses = [row[prompt_width:] for row in ids]
    if rows > 1 and prompt_width > 1 and response_width > 1:
        prompts[0], responses[-1] = prompts[0][1:], responses[-1][:-1]
    return SeqBatch.from_token_lists(prompts, responses, pad_id=0)


@dataclass
class _Recorded:
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    inputs: SeqBatch
    """The static inputs the forward reads (a replay copies a pass's tensors into them)."""
    logp: Tensor
    entropy: Tensor
    grad_logp: Tensor
    grad_entropy: Tensor | None
    """None: the entropy gets no gradient in this shape's passes (algorithm.entropy_coef 0)."""
    grads: list[Tensor | None]
    """Static gradients of PassGraphs.params, written by the backward graph (None: unused parameter)."""


class PassGraphs:
    """The recorded passes of one engine (see the module docstring)."""

    def __init__(
        self, model: nn.Module, params: list[nn.Parameter], stats: Stats, device: torch.device
    ) -> None:
        self.model = model
        self.params = params
        """The parameters that get gradients (requires_grad), in a fixed order."""
        self.stats = stats
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.recorded: OrderedDict[Key, _Recorded] = OrderedDict()
        self.off: str | None = None
        """Why graphs were turned off for this run (None while on)."""
        self.captures = 0
        self.replays = 0
        self._addresses = self._storage()
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        """An input of the replay's autograd Function so that the loss's backward reaches it."""

    # ------------------------------------------------------------------------------------ the engine's calls
    @staticmethod
    def key(sub: SeqBatch, entropy_grad: bool) -> Key | None:
        """The shape a pass is recorded under, None for a pass too large to record."""
        if sub.size * sub.input_ids.shape[1] > MAX_PASS_TOKENS or sub.routed_experts is not None:
            return None
        return (sub.size, sub.prompt_width, sub.response_width, entropy_grad)

    @contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run a step's passes (eager, captures and replays) on the side stream, ordered after what the current
        stream queued before and before what it queues after."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def replay(self, sub: SeqBatch, entropy_grad: bool) -> tuple[Tensor, Tensor] | None:
        """The pass's [b, R] log-probs and entropies from its shape's graphs, differentiable into the trainable
        parameters' `.grad`; None when its shape is not recorded (the engine runs it eagerly, then `record`)."""
        key = self.key(sub, entropy_grad)
        if self.off is not None or key is None or key not in self.recorded:
            return None
        self._check_storage()
        rec = self.recorded.get(key)
        if rec is None:
            return None
        self.recorded.move_to_end(key)
        rec.inputs.input_ids.copy_(sub.input_ids)
        rec.inputs.attention_mask.copy_(sub.attention_mask)
        rec.inputs.position_ids.copy_(sub.position_ids)
        rec.forward.replay()
        self.replays += 1
        logp, entropy = _Replay.apply(self._anchor, self, rec)
        return logp, entropy

    def record(self, sub: SeqBatch, entropy_grad: bool) -> None:
        """After an eager pass of `sub`'s shape (the warm-up): record its graphs, unless recorded, too large, or
        graphs are off. A failure turns graphs off for the run (one warning) and leaves training eager."""
        key = self.key(sub, entropy_grad)
        if self.off is not None or key is None or key in self.recorded:
            return
        while len(self.recorded) >= MAX_GRAPHS:
            self.recorded.popitem(last=False)
        try:
            self.recorded[key] = self._capture(sub, entropy_grad)
            self.captures += 1
        except Exception as e:  # noqa: BLE001  # any capture failure: eager passes are still right
            self.off = f"{type(e).__name__}: {e}"
            self.recorded.clear()
            log.warning(
                "trainer.cuda_graphs: recording a pass failed, training eagerly from here (%s)", self.off
            )

    def prerecord(self, sub: SeqBatch, entropy_grad: bool) -> bool:
        """Record `sub`'s shape before a step meets it: an eager forward and backward as the warm-up (its
        gradients dropped: no `.grad`, parameter or optimizer state changes), then the recording. True when the
        shape is now recorded and was not before. Call inside `on_stream`."""
        key = self.key(sub, entropy_grad)
        if self.off is not None or key is None or key in self.recorded:
            return False
        with torch.enable_grad():
            logp, entropy = self.stats(sub)
            outputs = [logp, entropy] if entropy_grad else [logp]
            torch.autograd.grad(
                outputs, self.params, [torch.ones_like(x) for x in outputs], allow_unused=True
            )
        del logp, entropy, outputs
        self.record(sub, entropy_grad)
        return key in self.recorded

    # ------------------------------------------------------------------------------------------- internals
    def _capture(self, sub: SeqBatch, entropy_grad: bool) -> _Recorded:
        inputs = SeqBatch(
            input_ids=sub.input_ids.clone(),
            attention_mask=sub.attention_mask.clone(),
            position_ids=sub.position_ids.clone(),
            response_mask=sub.response_mask,
            prompt_width=sub.prompt_width,
        )
        self.stream.synchronize()
        # no garbage collection while recording: a collected tensor's free would land inside the capture
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._record_pair(inputs, entropy_grad)
        finally:
            if collecting:
                gc.enable()

    def _record_pair(self, inputs: SeqBatch, entropy_grad: bool) -> _Recorded:
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.enable_grad():
            forward.capture_begin(pool=self.pool)
            try:
                logp, entropy = self.stats(inputs)
            finally:
                forward.capture_end()
            outputs = [logp, entropy] if entropy_grad else [logp]
            grad_logp = torch.zeros_like(logp)
            grad_entropy = torch.zeros_like(entropy) if entropy_grad else None
            grad_outputs = [grad_logp] if grad_entropy is None else [grad_logp, grad_entropy]
            backward.capture_begin(pool=self.pool)
            try:
                # no retain_graph: the forward's saved tensors go back to the pool once recorded, for the next
                # shape's recording to reuse (module docstring, Memory)
                grads = torch.autograd.grad(
                    outputs, self.params, grad_outputs=grad_outputs, allow_unused=True
                )
            finally:
                backward.capture_end()
        return _Recorded(forward, backward, inputs, logp, entropy, grad_logp, grad_entropy, list(grads))

    def _storage(self) -> list[int]:
        return [p.data_ptr() for p in self.model.parameters()]

    def _check_storage(self) -> None:
        now = self._storage()
        if now != self._addresses:
            log.info(
                "trainer.cuda_graphs: parameters moved in memory; the %d recorded passes are recorded again",
                len(self.recorded),
            )
            self.recorded.clear()
            self._addresses = now

    def accumulate(self, rec: _Recorded) -> None:
        """Add the backward graph's static gradients into the parameters' `.grad` (set where None)."""
        add_to, add_from, new_for, new_from = [], [], [], []
        for param, grad in zip(self.params, rec.grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                new_for.append(param)
                new_from.append(grad)
            else:
                add_to.append(param.grad)
                add_from.append(grad)
        if add_to:
            torch._foreach_add_(add_to, add_from)
        if new_for:
            for param, copy in zip(new_for, torch._foreach_mul(new_from, 1.0), strict=True):
                param.grad = copy


class _Replay(torch.autograd.Function):
    """Hands out a replayed forward's outputs; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, graphs: PassGraphs, rec: _Recorded) -> tuple[Tensor, Tensor]:  # type: ignore[override]  # torch declares *args
        ctx.graphs, ctx.rec = graphs, rec
        return rec.logp.detach().clone(), rec.entropy.detach().clone()

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_entropy: Tensor | None) -> tuple[None, None, None]:  # type: ignore[override]  # torch declares *grad_outputs
        rec: _Recorded = ctx.rec
        if g_logp is None:
            rec.grad_logp.zero_()
        else:
            rec.grad_logp.copy_(g_logp)
        if rec.grad_entropy is not None:
            if g_entropy is None:
                rec.grad_entropy.zero_()
            else:
                rec.grad_entropy.copy_(g_entropy)
        rec.backward.replay()
        ctx.graphs.accumulate(rec)
        return None, None, None
