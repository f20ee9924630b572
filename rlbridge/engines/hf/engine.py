"""The hf trainer engine: transformers + peft behind the TrainEngine protocol, for one CPU or GPU process.

What it takes care of, so the loop does not have to:
- LoRA / DoRA through peft (canonical_lora is plain LoRA here: peft already puts one adapter per q/k/v and
  gate/up projection), gradient checkpointing of whole decoder layers, non-reentrant, with the
  recompute-input fix in force (under reentrant checkpointing adapters inside recomputed layers would
  otherwise get no gradient).
- Log-probs only where they are needed: the output layer runs on the R + 1 last positions only
  (`logits_to_keep`); log-probs and entropies come from one chunked pass over those logits with a
  hand-written backward (rlbridge/engines/hf/token_stats.py): no [b, R, vocab] log-softmax, probabilities or
  zero-filled gather gradient. With a 49k vocabulary that output layer dominates both time and memory.
- No compute on padding: micro-batches (and log-prob chunks) take rows of similar length and each forward
  runs at its own rows' widths, not the whole batch's (rlbridge/engines/micro.py); per-token results are
  padded back to the batch's R before the loss closure sees them, so the closure is unchanged.
- trainer.cuda_graphs on a GPU: each training pass shape's forward and backward recorded once as CUDA graphs and
  replayed (rlbridge/engines/hf/graphs.py), the passes' prompt and response widths each rounded up to
  trainer.pass_width_multiple (SeqBatch.sides_rounded) so that a run meets few shapes.
- Reference log-probs from the same model with adapters disabled under LoRA; under full fine-tuning a
  frozen copy of the initial weights is kept, but only when algorithm.kl.coef > 0 (it doubles the weight
  memory: one more copy of every parameter in model.dtype, e.g. 540 MB for SmolLM2-135M in float32).
- A step that sees a non-finite loss or gradient is skipped (weights, optimizer and schedule untouched)
  and names the offending tensors.
- Merged export folds adapters into a copy of the weights in float32 (the live model is never merged);
  adapter export is exactly what peft's save_pretrained writes.
- bfloat16 / float16 models: the forward and backward run in the model's dtype, logits are cast to float32
  before log-softmax, and every trainable parameter that is not float32 gets a float32 master copy that
  AdamW steps (moments float32 too) and checkpoints store (rlbridge/engines/hf/master.py). peft keeps LoRA
  adapters float32 on a 16-bit base, so under LoRA they are their own masters. docs/engines/hf.md.

Gradient accumulation: train_step runs `num_micro_batches` forward/backward passes (rows grouped by
length: engines/micro.py) and backpropagates `loss_fn(...) / num_micro_batches` for each, so the update
follows the gradient of the *mean* of the micro-batch losses (`LOSS_SCALED_BY_MICRO_BATCHES`). A closure
whose micro-batch losses already sum to the mini-batch loss multiplies by num_micro_batches
(rlbridge.algo.objective does, with micro_scale); for such a closure any grouping of the rows, and any
number of passes (trainer.max_tokens_per_micro_batch), gives the same gradient.

This module holds the passes (log-probs, training, the update) and the checkpoint state; the model is built by
model.py and exported by export.py.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from rlbridge.batch import LossFn, SeqBatch, pad_columns
from rlbridge.engines.base import load_named, take_gradients
from rlbridge.engines.hf import moe as hf_moe
from rlbridge.engines.hf.export import HfWeights
from rlbridge.engines.hf.graphs import PRERECORD_MAX, PassGraphs, likely_widths, shape_batch
from rlbridge.engines.hf.master import MasterWeights
from rlbridge.engines.hf.model import apply_lora, apply_recompute, input_grads_enabled, load_model
from rlbridge.engines.hf.shared_prompts import (
    AUTO_DEVICES,
    cheaper,
    grouped_rows,
    plain_cache,
    shape_of,
    shared_response_logits,
)
from rlbridge.engines.hf.token_stats import logprobs_and_entropy, response_logits
from rlbridge.engines.hf.varlen import packed_token_stats, use_packed_attention
from rlbridge.engines.micro import forward_batch, micro_batch_rows, scoring_rows
from rlbridge.engines.optim import adamw_state, load_adamw_state, lr_at
from rlbridge.errors import RlbridgeError
from rlbridge.model.hf import DynamicCache, PeftModel
from rlbridge.model.routing import replay_routing
from rlbridge.plan import total_optimizer_steps
from rlbridge.recipe.schema import Recipe
from rlbridge.weights import WeightExport, WeightSync

log = logging.getLogger(__name__)


def _set_training(model: nn.Module, on: bool) -> None:
    """model.train(on) unless the model is already in that mode: the call walks every module (2.5k for SmolLM2
    with LoRA: ~4.5 ms of host time per step on a CPU core). The engine only switches the mode of whole models, so
    the root's flag is the model's."""
    if model.training != on:
        model.train(on)


def _fit(x_br: Tensor, width: int) -> Tensor:
    """[b, width]: per-token results of a pass brought to the batch's response width: trimmed columns back as 0
    (pad_columns), masked columns added beyond it (SeqBatch.sides_rounded) cut off."""
    return x_br[:, :width] if x_br.shape[1] > width else pad_columns(x_br, width)


def _masked(x_br: Tensor, mask_br: Tensor) -> Tensor:
    return torch.where(mask_br > 0, x_br, torch.zeros((), dtype=x_br.dtype, device=x_br.device))


# ------------------------------------------------------------------------------------------ engine
class HFTrainEngine:
    """TrainEngine over a transformers model (peft LoRA/DoRA when lora.rank > 0). See the module docstring."""

    LOSS_SCALED_BY_MICRO_BATCHES = True
    """train_step backpropagates loss_fn(...) / num_micro_batches (see the module docstring)."""
    padding_free = True
    """False: the former layout, index-order micro-batches and chunks at the full batch width (tests and
    bench/update_padding.py compare the two)."""

    @property
    def _max_tokens(self) -> int | None:
        """trainer.max_tokens_per_micro_batch: passes by token budget (engines/micro.py budget_rows)."""
        return self.recipe.trainer.max_tokens_per_micro_batch

    def __init__(
        self, recipe: Recipe, model_dir: Path, *, device: str = "cpu", total_steps: int | None = None
    ) -> None:
        self.recipe = recipe
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.total_steps = total_steps or total_optimizer_steps(recipe)
        self.num_optimizer_steps = 0
        self.lora = recipe.lora.enabled
        base = load_model(recipe, self.model_dir, self.device)
        self._reference: nn.Module | None = None
        if not self.lora and recipe.algorithm.kl.coef > 0:
            self._reference = copy.deepcopy(base).requires_grad_(False).eval()
        self.hf_model = base
        """The transformers model (with peft's layers injected under LoRA): HF parameter names."""
        self._peft: PeftModel | None = apply_lora(base, recipe) if self.lora else None
        self.model: nn.Module = self._peft if self._peft is not None else base
        """What is called: the PeftModel under LoRA, else the transformers model."""
        self._weights = HfWeights(base, self._peft, self.model_dir)
        """Merged and adapter exports of the live model (export.py)."""
        apply_recompute(base, recipe, self.device)
        self.packed = recipe.trainer.packed_passes
        """trainer.packed_passes: each pass's rows as one row of real tokens with varlen attention (varlen.py)."""
        if self.packed:
            for m in (base, self._reference):
                if m is not None:
                    use_packed_attention(m)
        self._shared_logged: bool | None = None
        self._can_share = self.packed or (
            recipe.trainer.recompute.granularity == "none" and plain_cache(DynamicCache(config=base.config))
        )
        """Shared prompts (trainer.shared_prompts) in padded passes need the model's KV cache in the training
        forward: no recompute (transformers drops the cache of checkpointed layers), plain dynamic layers (no sliding
        window); packed passes share prompts by their attention segments (varlen.shared_layout), with no cache."""
        self.master = MasterWeights([(n, p) for n, p in self.model.named_parameters() if p.requires_grad])
        """Float32 masters of low-precision trainable parameters (rlbridge/engines/hf/master.py)."""
        self._trainable = self.master.named
        """(name, parameter the optimizer steps): float32 masters under the model's parameter names."""
        self.moe: hf_moe.HfMoeBook | None = None
        """Router hooks and per-expert LoRA views of an MoE model (None for a dense one): the first-step gate."""
        if hf_moe.num_experts(base.config):
            self.moe = hf_moe.HfMoeBook(
                self.model,
                self._trainable,
                hf_moe.num_experts(base.config),
                int(getattr(base.config, "num_experts_per_tok", 1) or 1),
            )
        optim = recipe.trainer.optim
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self._trainable],
            lr=lr_at(optim, 0, self.total_steps),
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.model.eval()  # one mode for every module (peft and checkpointing leave them mixed): _set_training
        self._graphs: PassGraphs | None = self._pass_graphs() if recipe.trainer.cuda_graphs else None
        """trainer.cuda_graphs: the recorded training passes (engines/hf/graphs.py)."""
        self.sides = self._graphs is not None
        """Training passes with prompt and response widths each rounded up to trainer.pass_width_multiple
        (SeqBatch.sides_rounded): the few shapes recorded passes need. True under trainer.cuda_graphs (tests set
        it on a CPU: the layout is exact on its own)."""

    # -------------------------------------------------------------------------------- set-up
    # -------------------------------------------------------------------------------- set-up
    def _pass_graphs(self) -> PassGraphs:
        """trainer.cuda_graphs (validate-recipe refuses the recipes it cannot record; this guards the rest)."""
        if self.device.type != "cuda":
            raise RlbridgeError(f"trainer.cuda_graphs needs a CUDA device, the trainer runs on {self.device}")
        if self.moe is not None:
            raise RlbridgeError(
                "trainer.cuda_graphs: an MoE model's passes are not recorded (set it to false)"
            )
        if self.master.num_copies or self.recipe.trainer.recompute.granularity != "none":
            raise RlbridgeError(
                "trainer.cuda_graphs needs float32 trainable parameters and trainer.recompute.granularity none"
            )
        params = [p for p in self.model.parameters() if p.requires_grad]
        return PassGraphs(
            self.model, params, lambda sub: self._token_stats(self.model, sub, False), self.device
        )

    def input_grads_enabled(self) -> bool:
        """Whether the embedding output requires grad with a frozen embedding (the recompute-input fix)."""
        return input_grads_enabled(self.hf_model, self.device)

    # ------------------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def logprobs(self, batch: SeqBatch, *, reference: bool = False) -> Tensor:
        """[b, R] float32 log-probs of the response tokens (0 on padding), `trainer.logprob_chunk_size`
        rows per forward pass; returned on the batch's device."""
        out = torch.zeros(batch.size, batch.response_width, device=batch.input_ids.device)
        # in the training passes' layout (sides: trainer.cuda_graphs), so old log-probs match the training forward's
        plain = scoring_rows(
            batch,
            self.recipe.trainer,
            by_length=self.padding_free,
            width_multiple=self._width(False),
            sides=self.sides,
            packed=self.packed,
        )
        budget = None if self.recipe.trainer.logprob_chunk_size else self._max_tokens
        groups, shared = self._layout(batch, plain, len(plain), budget)
        with self._scoring_model(reference) as model:
            _set_training(model, False)
            for rows in groups:
                with record_function("rlbridge.pass_batch"):
                    sub = self._pass_batch(batch, rows, shared)
                with replay_routing(model, sub.routed_experts):
                    logp, _ = self._token_stats(model, sub, shared)
                out[rows.to(out.device)] = _fit(_masked(logp, sub.response_mask), batch.response_width).to(
                    out.device
                )
        return out

    @contextlib.contextmanager
    def _scoring_model(self, reference: bool) -> Iterator[nn.Module]:
        if not reference:
            yield self.model
        elif self._peft is not None:
            with self._peft.disable_adapter():
                yield self._peft
        elif self._reference is not None:
            yield self._reference
        else:
            raise RlbridgeError(
                "reference log-probs under full fine-tuning need a frozen copy of the initial weights, kept only "
                "when algorithm.kl.coef > 0; set it, or use LoRA (lora.rank > 0) whose reference is free"
            )

    # ------------------------------------------------------------------------------ training
    def train_step(self, batch: SeqBatch, loss_fn: LossFn, *, num_micro_batches: int) -> dict[str, Any]:
        """One optimizer step over `batch` split into `num_micro_batches` row groups (sizes differ by at
        most one), or into as many as trainer.max_tokens_per_micro_batch needs (each pass's loss still
        divided by num_micro_batches: engines/micro.py). Metrics: loss_fn's metrics averaged over the passes,
        grad_norm (before clipping), lr, skipped (0.0 / 1.0) and, on a skipped step only, `nonfinite` (a list
        of names)."""
        replays = 0 if self._graphs is None else self._graphs.replays
        metrics, bad_loss = self._accumulate(batch, loss_fn, num_micro_batches)
        with record_function("rlbridge.optimizer"):
            metrics.update(self._apply_update(bad_loss))
        if self._graphs is not None:  # passes of this step replayed from their recorded graphs
            metrics["cuda_graph_passes"] = float(self._graphs.replays - replays)
        return metrics

    def prerecord(self, prompt_lengths: list[int], passes: list[tuple[int, int]]) -> int:
        """trainer.cuda_graphs: record, before the first step, the pass shapes its steps are likely to meet
        (graphs.likely_widths from the training prompts' token counts) for each (rows, micro-batches) in `passes`
        (the role's mini-batch shards), at most graphs.PRERECORD_MAX. Without it a step that meets a new shape
        runs it eagerly and records it, in the middle of a run (docs/defaults.md#cuda-graphs).
        Nothing a step reads changes: no gradient is kept, no parameter or optimizer state is touched, and the
        random generators are put back. Returns the shapes recorded."""
        graphs = self._graphs
        if graphs is None or self.recipe.trainer.shared_prompts == "always":
            return 0
        r = self.recipe
        widths = likely_widths(
            prompt_lengths,
            prompts_per_step=r.data.batch_size,
            max_response=r.rollout.max_response_tokens,
            multiple=self._width(False),
        )
        vocab = int(self.hf_model.config.vocab_size)
        recorded = 0
        _set_training(self.model, True)
        with torch.random.fork_rng(devices=[self.device]), graphs.on_stream():
            for prompt_width, response_width in widths:
                for rows, num_micro in passes:
                    batch = shape_batch(rows, prompt_width, response_width, vocab)
                    for group in self._plain_passes(batch, num_micro):
                        if recorded >= PRERECORD_MAX:
                            return recorded
                        sub = self._pass_batch(batch, group, False)
                        recorded += graphs.prerecord(sub, self.recipe.algorithm.trains_entropy)
                    if graphs.off is not None:
                        return recorded
        return recorded

    def gradients(self, batch: SeqBatch, loss_fn: LossFn, *, num_micro_batches: int) -> dict[str, Tensor]:
        """The accumulated gradient train_step would clip and apply, without stepping (tests, diagnostics)."""
        self._accumulate(batch, loss_fn, num_micro_batches)
        return take_gradients(self._trainable, self.optimizer)

    def _accumulate(
        self, batch: SeqBatch, loss_fn: LossFn, num_micro_batches: int
    ) -> tuple[dict[str, Any], bool]:
        """Forward/backward every micro-batch into .grad; stops at the first non-finite loss (returns True)."""
        with record_function("rlbridge.layout"):
            plain = self._plain_passes(batch, num_micro_batches)
            groups, shared = self._layout(batch, plain, num_micro_batches, self._max_tokens)
        _set_training(self.model, True)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        done = 0
        graphs = None if shared else self._graphs
        with graphs.on_stream() if graphs is not None else contextlib.nullcontext():
            for rows in groups:
                with record_function("rlbridge.pass_batch"):
                    sub = self._pass_batch(batch, rows, shared)
                # the replay covers the backward too: recomputed (checkpointed) forwards route as the first one did
                with replay_routing(self.model, sub.routed_experts):
                    loss, metrics = self._micro_step(sub, rows, loss_fn, batch.response_width, shared)
                    if not bool(torch.isfinite(loss.detach())):
                        return {k: v / max(done, 1) for k, v in sums.items()}, True
                    with record_function("rlbridge.backward"):
                        (loss / num_micro_batches).backward()
                if graphs is not None:  # an eager pass of a new shape was its warm-up: record it now
                    graphs.record(sub, self.recipe.algorithm.trains_entropy)
                done += 1
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        return {k: v / done for k, v in sums.items()}, False

    def _micro_step(
        self, sub: SeqBatch, rows: Tensor, loss_fn: LossFn, width: int, shared: bool
    ) -> tuple[Tensor, dict[str, float]]:
        """`sub`: the rows' forward batch (forward_batch); `width`: the full batch's R, which the closure indexes."""
        replayed = (
            None
            if shared or self._graphs is None
            else self._graphs.replay(sub, self.recipe.algorithm.trains_entropy)
        )
        with record_function("rlbridge.forward"):
            logp, entropy = replayed or self._token_stats(self.model, sub, shared)
        logp = _masked(logp, sub.response_mask)
        if not self.recipe.algorithm.trains_entropy:  # a metric only: no gradient pass for it
            entropy = entropy.detach()
        # the closure indexes [b, R] tensors: trimmed columns come back as 0, masked ones added beyond R go
        with record_function("rlbridge.loss"):
            return loss_fn(_fit(logp, width), _fit(_masked(entropy, sub.response_mask), width), rows)

    def _plain_passes(self, batch: SeqBatch, num_micro_batches: int) -> list[Tensor]:
        """The rows of each training pass over `batch` in the plain layout (engines/micro.py micro_batch_rows)."""
        return micro_batch_rows(
            batch,
            num_micro_batches,
            by_length=self.padding_free,
            max_tokens=self._max_tokens,
            width_multiple=self._width(False),
            sides=self.sides,
            packed=self.packed,
        )

    def _layout(
        self, batch: SeqBatch, plain: list[Tensor], num_groups: int, max_tokens: int | None
    ) -> tuple[list[Tensor], bool]:
        """The passes over `batch`: `plain` (rows grouped by length) or, where trainer.shared_prompts allows it,
        passes that keep each prompt's rows together and run each distinct prompt once (shared_prompts.py):
        always, or under auto on a CPU when that computes at most shared_prompts.SAVING of the plain positions
        (on a GPU auto keeps the plain passes: shared_prompts.AUTO_DEVICES)."""
        mode = self.recipe.trainer.shared_prompts
        if (
            mode == "never"
            or not self._can_share
            or not self.padding_free
            or batch.routed_experts is not None
        ):
            return plain, False
        if mode == "auto" and self.device.type not in AUTO_DEVICES:
            return plain, False
        shape = shape_of(batch)
        shared = grouped_rows(batch, num_groups, max_tokens=max_tokens, shape=shape, packed=self.packed)
        use = mode == "always" or cheaper(batch, plain, shared, shape=shape, packed=self.packed)
        if use != self._shared_logged:  # once per run, and again when the choice changes
            self._shared_logged = use
            log.info(
                "trainer.shared_prompts %s: %s (%d rows, %d distinct prompts)",
                mode,
                "each distinct prompt once per pass" if use else "plain passes (not enough shared positions)",
                batch.size,
                shape.num_prompts,
            )
        return (shared, True) if use else (plain, False)

    def _pass_batch(self, batch: SeqBatch, rows: Tensor, shared: bool) -> SeqBatch:
        """The rows' forward batch on the device, in the layout of this engine's passes (trimmed, widths rounded;
        both sides under trainer.cuda_graphs), for the training and the no-gradient passes alike."""
        return forward_batch(
            batch,
            rows,
            self.device,
            trim=self.padding_free,
            width_multiple=self._width(shared),
            sides=self.sides and not shared,
        )

    def _width(self, shared: bool) -> int:
        """trainer.pass_width_multiple for the plain passes; the shared-prompt passes keep their own widths."""
        return 1 if shared else self.recipe.trainer.width_multiple(self.device.type)

    def _token_stats(self, model: nn.Module, sub: SeqBatch, shared: bool) -> tuple[Tensor, Tensor]:
        """[b, R] log-probs and entropies of a forward batch's response tokens, in one forward or with its
        distinct prompts run once (shared)."""
        if self.packed:
            return packed_token_stats(model, sub, shared=shared)
        if not shared:
            return logprobs_and_entropy(response_logits(model, sub), sub.response_ids)
        head, rest = shared_response_logits(model, sub)
        ids = sub.response_ids
        logp0, entropy0 = logprobs_and_entropy(head, ids[:, :1])
        if rest.shape[1] == 0:
            return logp0, entropy0
        logp, entropy = logprobs_and_entropy(rest, ids[:, 1:])
        return torch.cat([logp0, logp], dim=1), torch.cat([entropy0, entropy], dim=1)

    def _apply_update(self, bad_loss: bool) -> dict[str, Any]:
        """Check, clip, step; or skip and name what was not finite."""
        lr = lr_at(self.recipe.trainer.optim, self.num_optimizer_steps, self.total_steps)
        grads = [p.grad for _, p in self._trainable if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if bad_loss or not bool(torch.isfinite(norm)):
            names = [
                n for n, p in self._trainable if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ]
            self.optimizer.zero_grad(set_to_none=True)
            nonfinite = (["loss"] if bad_loss else []) + (names or ([] if bad_loss else ["grad_norm"]))
            return {"grad_norm": float(norm), "lr": lr, "skipped": 1.0, "nonfinite": nonfinite}
        clip = self.recipe.trainer.optim.clip_grad
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_([p for _, p in self._trainable], clip, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.master.to_model()
        self.num_optimizer_steps += 1
        return {"grad_norm": float(norm), "lr": lr, "skipped": 0.0}

    # ---------------------------------------------------------------------------- export
    # ---------------------------------------------------------------------------- export
    def export_weights(self, kind: WeightSync) -> WeightExport:
        """'merged' or 'adapter' weights (export.py: HfWeights.export)."""
        return self._weights.export(kind)

    def merged_state(self, *, drop_tied: bool = True) -> dict[str, Tensor]:
        """Every weight under the HF checkpoint's names, adapters folded in (export.py: HfWeights.merged_state)."""
        return self._weights.merged_state(drop_tied=drop_tied)

    # ---------------------------------------------------------------------- state for checkpoints
    def trainable_state(self) -> dict[str, Tensor]:
        """Copies of the trainable tensors (adapters under LoRA), under the live model's parameter names; the
        float32 masters of a bfloat16 / float16 model, not their rounding."""
        return {n: p.detach().clone() for n, p in self._trainable}

    def load_trainable_state(self, tensors: dict[str, Tensor]) -> None:
        load_named(self._trainable, tensors, "the model's trainable")
        self.master.to_model()

    def frozen_fingerprint(self) -> dict[str, float]:
        """sum |w| (float64) of every frozen tensor of the live model."""
        return {
            n: float(p.detach().abs().sum(dtype=torch.float64))
            for n, p in self.model.named_parameters()
            if not p.requires_grad
        }

    def optimizer_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """AdamW state as named tensors (`<param>:step|exp_avg|exp_avg_sq`) and a JSON-able dict (schedule
        position, hyper-parameters, the names with state). No pickle anywhere."""
        return adamw_state(
            self.optimizer,
            self._trainable,
            {"step": self.num_optimizer_steps, "total_steps": self.total_steps},
        )

    def load_optimizer_state(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        load_adamw_state(self.optimizer, self._trainable, tensors, meta)
        self.num_optimizer_steps = int(meta["scheduler"]["step"])  # total_steps stays the recipe's
