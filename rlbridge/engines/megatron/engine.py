"""The megatron trainer engine: megatron-core models through Megatron-Bridge (or mbridge), one rank each.

The caller initializes torch.distributed (gloo on CPU, NCCL on GPUs) and hands every rank the same recipe;
each data-parallel rank gets its own SeqBatch, tensor/pipeline ranks of one replica the same one. From
there the engine owns the Megatron side:

* parallel state (tp, pp, vpp, cp, ep, etp) and the provider come from one mapping table (provider.py);
* PEFT (LoRA / DoRA / canonical LoRA) is applied before DDP and the optimizer, and the engine proves it:
  trainable at wrap == optimizer == grad buffers == adapters (params.py), else it refuses to start;
* the recompute-input fix is verified (and applied where a Megatron-Bridge version does not);
* log-probs and the training pass go through megatron-core's pipeline schedule with vocab-parallel
  log-softmax (forward.py); reference log-probs under LoRA come from the same model with its adapters
  disabled, under full fine-tuning from a host copy of the initial weights (only when kl.coef > 0);
* the update is megatron-core's optimizer (Adam, clipping, mixed precision) with the hf engine's LR
  schedule; a step with a non-finite loss or gradient is skipped and names the tensors;
* exports go through the bridge (export.py).

Conventions shared with the hf engine: micro-batches are `tensor_split` row groups (without pipeline or context
parallelism, of rows grouped by length and trimmed to their own widths, or formed by the token budget
trainer.max_tokens_per_micro_batch: engines/micro.py), each pass backpropagates its loss / num_micro_batches
(`LOSS_SCALED_BY_MICRO_BATCHES`; forward.nominal_scale when a budget runs another number of passes), log-probs
are [b, R] float32 with 0 on padding.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlbridge.batch import LossFn, SeqBatch, pad_columns
from rlbridge.engines.base import load_named
from rlbridge.engines.megatron import build as B
from rlbridge.engines.megatron import compat, export, forward, params, state
from rlbridge.engines.megatron import provider as P
from rlbridge.engines.megatron.moe import MoeBook
from rlbridge.engines.micro import scoring_passes
from rlbridge.engines.optim import lr_at
from rlbridge.errors import RlbridgeError
from rlbridge.plan import total_optimizer_steps
from rlbridge.recipe.schema import Recipe
from rlbridge.weights import WeightExport, WeightSync


class MegatronTrainEngine:
    """TrainEngine for one rank of an initialized torch.distributed group. See the module docstring."""

    LOSS_SCALED_BY_MICRO_BATCHES = True
    padding_free = True
    """Without pipeline and context parallelism, micro-batches of rows grouped by length, each at its rows' own
    widths (engines/micro.py); False: the former index-order micro-batches at the whole batch's width (tests)."""

    def __init__(self, recipe: Recipe, *, total_steps: int | None = None) -> None:
        compat.activate()
        B.check_backend(recipe)
        self.recipe = recipe
        self.lora = recipe.lora.enabled
        self.total_steps = total_steps or total_optimizer_steps(recipe)
        self.num_optimizer_steps = 0
        self._warned_micro = False
        self.max_tokens = recipe.trainer.max_tokens_per_micro_batch
        """Training passes by this token budget (engines/micro.py budget_rows) where micro-batches are grouped
        by length (`_by_length`); the recipe checks refuse it under pipeline or context parallelism."""
        with compat.device_scope():
            self.built = P.build(recipe)
            if getattr(
                self.built.provider, "num_moe_experts", None
            ):  # before the weights load (expert numbers)
                export.install_sequential_expert_export()
            self._owns_parallel_state = B.init_parallel(self.built.provider, recipe.run.seed)
            if recipe.trainer.bridge == "mbridge":
                self.bundle = B.build_mbridge(self.built, recipe)
            else:
                self.bundle = B.build_megatron_bridge(self.built)
            self.model: list[torch.nn.Module] = self.bundle.chunks
            self.recompute_fix = B.ensure_recompute_input_fix(self.model)
            self.optimizer = B.build_optimizer(self.built, self.model)
            if recipe.model.dtype != "float32":
                forward.float32_output_layer(self.model)  # unrounded float32 logits, as the hf engine's
            forward.response_head(self.model)  # logits on the response positions only, as the hf engine's
            self.param_sets = params.param_sets(self.model, self.optimizer, self.bundle.at_wrap, self.lora)
            params.check_param_sets(self.param_sets)
            export.install_pp_duplicate_check()
        self._trainable = params.trainable(self.model)
        self.moe: MoeBook | None = None
        """Router hooks and expert map of an MoE model (None for a dense one); read by the first-step gate."""
        if getattr(self.built.provider, "num_moe_experts", None):
            self.moe = MoeBook(self.model, self._trainable)
        self.device = next(self.model[0].parameters()).device
        self._reference_weights: list[torch.Tensor] | None = None
        if not self.lora and recipe.algorithm.kl.coef > 0:
            self._reference_weights = [p.detach().to("cpu", copy=True) for _, p in self._trainable]
        self._set_lr()

    # --------------------------------------------------------------------------------- helpers
    def _split(
        self, batch: SeqBatch, num: int, *, training: bool = False, budget: bool = False
    ) -> list[forward.MicroBatch]:
        provider = self.built.provider
        pp = provider.pipeline_model_parallel_size
        interleaved = pp > 1 and provider.virtual_pipeline_model_parallel_size is not None
        if training and interleaved and num % pp:
            raise RlbridgeError(
                f"the interleaved pipeline schedule needs a multiple of pipeline={pp} micro-batches per step, "
                f"got {num}: change the mini-batch size or trainer.micro_batch_size"
            )
        rows = -(-batch.size // num)
        if training and rows > self.built.run.micro_batch_size and not self._warned_micro:
            self._warned_micro = True
            warnings.warn(
                f"micro-batches of {rows} rows exceed trainer.micro_batch_size={self.built.run.micro_batch_size}, "
                "the size activation memory was planned for",
                stacklevel=3,
            )
        return forward.split_micro_batches(
            batch.to(self.device),
            num,
            seq_multiple=math.lcm(
                provider.tensor_model_parallel_size if provider.sequence_parallel else 1,
                self.recipe.trainer.width_multiple(self.device.type),
            ),
            equal_rows=pp > 1,
            count_multiple=pp if interleaved else 1,
            by_length=self._by_length(),
            max_tokens=self.max_tokens if training or budget else None,
        )

    def _by_length(self) -> bool:
        """Length-grouped, trimmed micro-batches only without pipeline parallelism (every stage-to-stage send
        has one fixed shape) and without context parallelism (it shards the sequence): those keep the former
        index-order micro-batches at the batch's width."""
        provider = self.built.provider
        cp = getattr(provider, "context_parallel_size", 1) or 1
        return self.padding_free and provider.pipeline_model_parallel_size == 1 and cp == 1

    def _set_lr(self) -> float:
        lr = lr_at(self.recipe.trainer.optim, self.num_optimizer_steps, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    @contextlib.contextmanager
    def _reference(self) -> Iterator[None]:
        """The reference policy on the same model: adapters off (LoRA) or the initial weights swapped in."""
        if self.lora:
            with self.built.peft.disable_adapter(self.model):
                yield
            return
        if self._reference_weights is None:
            raise RlbridgeError(
                "reference log-probs under full fine-tuning need a copy of the initial weights, kept only when "
                "algorithm.kl.coef > 0; set it, or use LoRA (lora.rank > 0) whose reference is free"
            )
        current = [p.detach().to("cpu", copy=True) for _, p in self._trainable]
        with torch.no_grad():
            for (_, p), ref in zip(self._trainable, self._reference_weights, strict=True):
                p.copy_(ref)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), now in zip(self._trainable, current, strict=True):
                    p.copy_(now)

    # ------------------------------------------------------------------------------- log-probs
    @torch.no_grad()
    def logprobs(self, batch: SeqBatch, *, reference: bool = False) -> torch.Tensor:
        """[b, R] float32 log-probs of the response tokens (0 on padding), `trainer.logprob_chunk_size`
        rows per micro-batch, identical on every rank of the model-parallel group."""
        num, budget = scoring_passes(
            batch.size, self.built.run.logprob_chunk_size, self.built.run.micro_batch_size
        )
        vocab = self.bundle.vocab_size

        def stage(output: torch.Tensor, mb: forward.MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
            logits, targets = forward.response_logits(output, mb)
            logp, _ = forward.vocab_parallel_logprobs(logits, targets, vocab_size=vocab, with_entropy=False)
            return output.new_zeros(()), {"logprobs": logp}

        scope = self._reference() if reference else contextlib.nullcontext()
        with compat.device_scope(), forward.train_mode(self.model, False), scope:
            mbs = self._split(batch, num, budget=budget)
            results = forward.run_schedule(self.model, mbs, stage, forward_only=True)
            parts = [r["logprobs"] for r in results]
            out = forward.batch_rows(parts, mbs, batch.size, batch.response_width) if results else None
            out = forward.broadcast_from_last_stage(out)
        mask = batch.response_mask.to(out.device) > 0
        return torch.where(mask, out.float(), torch.zeros((), dtype=torch.float32)).to(batch.input_ids.device)

    # -------------------------------------------------------------------------------- training
    def train_step(self, batch: SeqBatch, loss_fn: LossFn, *, num_micro_batches: int) -> dict[str, Any]:
        """One optimizer step over `batch` in `num_micro_batches` row groups, or as many as the token budget
        needs (`max_tokens`). Metrics: loss_fn's metrics averaged over the passes run, loss, grad_norm (before
        clipping), lr, skipped and, on a skipped step, `nonfinite` (a list of names)."""
        metrics = self._accumulate(batch, loss_fn, num_micro_batches)
        with compat.device_scope():
            metrics.update(self._apply_update(bad_loss=not forward.finite(metrics.get("loss", 0.0))))
        return metrics

    def gradients(
        self, batch: SeqBatch, loss_fn: LossFn, *, num_micro_batches: int
    ) -> dict[str, torch.Tensor]:
        """The accumulated (data-parallel averaged) gradient train_step would clip and apply, without
        stepping: this rank's shards, under the names of trainable_state()."""
        self._accumulate(batch, loss_fn, num_micro_batches)
        grads = {}
        for name, p in self._trainable:
            g = params.main_grad(p)
            grads[name] = g.detach().clone() if g is not None else torch.zeros_like(p)
        self._zero_grads()
        return grads

    def _zero_grads(self) -> None:
        forward.zero_grads(self.model, self.optimizer)

    def _accumulate(self, batch: SeqBatch, loss_fn: LossFn, num_micro_batches: int) -> dict[str, Any]:
        """Forward/backward every micro-batch through the schedule; the metrics' means over the passes run."""
        vocab = self.bundle.vocab_size
        entropy_grad = self.recipe.algorithm.trains_entropy  # else a metric only, without autograd

        def stage(output: torch.Tensor, mb: forward.MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
            logits, targets = forward.response_logits(output, mb)
            logp, entropy = forward.vocab_parallel_logprobs(
                logits, targets, vocab_size=vocab, with_entropy=True, entropy_grad=entropy_grad
            )
            assert entropy is not None
            # the closure indexes [b, R] tensors: columns a trimmed micro-batch dropped come back as 0
            width = batch.response_width
            logp, entropy = pad_columns(logp, width), pad_columns(entropy, width)
            mask = batch.response_mask[mb.rows].to(logp.device) > 0
            zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
            loss, metrics = loss_fn(torch.where(mask, logp, zero), torch.where(mask, entropy, zero), mb.rows)
            loss = loss * scale  # a new tensor: the schedule divides the returned loss in place
            reduced = {k: float(v) for k, v in metrics.items()}
            reduced["loss"] = float(loss.detach())
            return loss, reduced

        with compat.device_scope(), forward.train_mode(self.model, True):
            self._zero_grads()
            mbs = self._split(batch, num_micro_batches, training=True)
            scale = forward.nominal_scale(len(mbs), num_micro_batches)
            results = forward.run_schedule(self.model, mbs, stage, forward_only=False)
            metrics = _mean(results) if results else None
            return dict(forward.broadcast_from_last_stage(metrics))

    def _apply_update(self, *, bad_loss: bool) -> dict[str, Any]:
        """megatron-core's step split open: check for non-finite values first, then clip and step."""
        found_inf = bool(self.optimizer.prepare_grads())
        norm = float(self.optimizer.get_grad_norm())
        lr = self._set_lr()
        if bad_loss or found_inf or not forward.finite(norm):
            names = self._nonfinite_names()
            self._zero_grads()
            nonfinite = (["loss"] if bad_loss else []) + (names or ([] if bad_loss else ["grad_norm"]))
            return {"grad_norm": norm, "lr": lr, "skipped": 1.0, "nonfinite": nonfinite}
        forward.clip_and_step(self.optimizer, norm)
        self._zero_grads()
        self.num_optimizer_steps += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    def _nonfinite_names(self) -> list[str]:
        """Trainable tensors with a non-finite gradient on any rank (collective over the world)."""
        local = []
        for name, p in self._trainable:
            g = params.main_grad(p)
            if g is not None and not bool(torch.isfinite(g).all()):
                local.append(name)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return sorted({n for names in gathered for n in names})

    # ---------------------------------------------------------------------------------- export
    def export_weights(self, kind: WeightSync) -> WeightExport:
        """'merged': every HF weight (adapters folded in by the bridge), as save_pretrained names them (a tied
        lm_head is left out). 'adapter': PEFT lora_A / lora_B and adapter_config.json content. Collective:
        every rank of the model-parallel group must call it; every rank gets the full tensors."""
        if self.recipe.lora.type == "dora" and self.lora:
            raise RlbridgeError(
                "exporting DoRA from the megatron engine is not supported: Megatron-Bridge's exporters ignore "
                "DoRA's magnitude vector (the merge would be wrong); use lora.type lora or the hf engine"
            )
        with compat.device_scope():
            if kind == WeightSync.MERGED:
                tensors = export.normalize_merged_names(
                    self.bundle.export_merged(self.model), tied=self.bundle.tied
                )
                return WeightExport(WeightSync.MERGED, tensors)
            if kind == WeightSync.ADAPTER:
                if self.bundle.export_adapter is None:
                    raise RlbridgeError(
                        "adapter export needs LoRA (lora.rank > 0); use merged weights for full fine-tuning"
                    )
                tensors = export.peft_adapter_names(self.bundle.export_adapter(self.model))
                return WeightExport(WeightSync.ADAPTER, tensors, export.peft_adapter_config(self.recipe))
        raise ValueError(f"unknown export kind {kind!r} (expected 'merged' or 'adapter')")

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this rank's data-parallel replica: TrainerRole hands each replica its share of
        the rows (tensor/pipeline ranks of one replica get the same rows)."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def coordinates(self) -> dict[str, int]:
        """This rank's place in the layout, as megatron's parallel state sees it."""
        from megatron.core import parallel_state as ps

        return {
            "rank": dist.get_rank(),
            "dp": ps.get_data_parallel_rank(),
            "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "cp": ps.get_context_parallel_rank(),
        }

    # ------------------------------------------------------------------------ state / fingerprints
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Copies of this rank's trainable tensors (adapters under LoRA), under Megatron names (local shards;
        `chunk<i>.` prefixes with virtual pipeline stages)."""
        return {n: p.detach().clone() for n, p in self._trainable}

    def load_trainable_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_named(self._trainable, tensors, "the model's trainable")
        self.optimizer.reload_model_params()  # mixed precision keeps fp32 main copies

    def checkpoint_problem(self) -> str | None:
        """Why this layout cannot checkpoint yet, or None."""
        return state.unsupported(self.recipe)

    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """Collective: full fp32 trainable tensors and Adam moments under canonical names on global rank 0
        (engines/megatron/state.py), and the schedule position and layout as metadata on every rank."""
        with compat.device_scope():
            groups = state.gather_state(self.model, self.optimizer)
        meta = {
            "format": state.FORMAT,
            "scheduler": {"step": self.num_optimizer_steps, "total_steps": self.total_steps},
            "layout": layout(self.built.provider),
        }
        return groups, meta

    def load_checkpoint_state(self, groups: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> None:
        """Every rank: its shards of the checkpoint's full tensors, Adam's state and the schedule position."""
        if meta.get("format") != state.FORMAT:
            raise RlbridgeError(
                f"unknown megatron checkpoint format {meta.get('format')!r} (expected {state.FORMAT})"
            )
        with compat.device_scope():
            state.load_state(
                self.model, self.optimizer, groups["trainable"], groups.get("optimizer", {}), "the policy"
            )
        self.num_optimizer_steps = int(meta["scheduler"]["step"])
        self._set_lr()

    def frozen_fingerprint(self) -> dict[str, float]:
        """sum |w| (float64) of every frozen tensor on this rank."""
        return {
            n: float(p.detach().abs().sum(dtype=torch.float64))
            for n, p in params.named_parameters(self.model)
            if not p.requires_grad
        }

    def close(self) -> None:
        """Release the parallel state if this engine created it (another engine can then be built)."""
        if self._owns_parallel_state:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            self._owns_parallel_state = False


def layout(provider: Any) -> dict[str, int | None]:
    """The parallel sizes a checkpoint was written at (informational: checkpoints load at any layout)."""
    from megatron.core import parallel_state as ps

    return {
        "tensor": int(provider.tensor_model_parallel_size),
        "pipeline": int(provider.pipeline_model_parallel_size),
        "virtual_pipeline": provider.virtual_pipeline_model_parallel_size,
        "expert": int(getattr(provider, "expert_model_parallel_size", 1) or 1),
        "data": ps.get_data_parallel_world_size(),
        "world": dist.get_world_size(),
    }


def _mean(items: list[dict[str, Any]]) -> dict[str, float]:
    keys = {k for item in items for k in item}
    return {k: sum(float(i[k]) for i in items if k in i) / sum(1 for i in items if k in i) for k in keys}
