"""PPO's critic on the megatron engine: a second megatron model whose output layer is a value head.

Same interface and conventions as the hf engine's critic (engines/hf/critic.py): `values(batch)` gives
V(s_t) for every response token, read from the last hidden state at the position that predicts token t
(P + t - 1); `train_step(batch, value_fn, num_micro_batches)` takes one optimizer step on the value loss.

Design, one rank of the trainer's torch.distributed group (the policy's MegatronTrainEngine built first):

* the model is built through the same path as the policy's (provider.py's table -> Megatron-Bridge ->
  `provide_distributed_model`), from the same checkpoint, with its own LoRA from the recipe's lora section
  (or fully trained when lora.rank is 0). The parallel state is the policy's: same sizes, same groups.
* a pre-wrap hook, after PEFT and the weight loading and before the DDP wrap, replaces GPTModel's
  `output_layer` by `ValueHead`, a float32 `nn.Linear(hidden, 1)` (init as the hf critic's: normal with std
  1/(hidden+1) from run.seed, zero bias). So the DDP grad buffers and megatron's optimizer hold exactly the
  adapters (or the whole backbone) plus the head, which `params.check_param_sets` verifies.
* tensor parallelism: without sequence parallelism the decoder's output hidden states are replicated on
  every TP rank, and so is the head. Each TP rank computes the same values and the same loss, so the head's
  gradient is the same on every TP rank (as for megatron's own layer norms), and the gradient flowing back
  into the decoder is the full one on every rank, which is what megatron's TP layers expect of the
  replicated residual stream (a vocab-parallel output layer has to all-reduce it instead). The head is a
  TP duplicate for the gradient norm (counted on TP rank 0 only). Sequence and context parallelism would
  shard the hidden states over the sequence and are rejected by the recipe checks, as is pipeline
  parallelism (recipe/checks/training.py check_algorithm).
* the update is megatron-core's optimizer (Adam, clipping from trainer.optim, mixed precision where the
  model is bf16/fp16; the head stays float32) at the constant algorithm.critic.lr; data parallelism
  averages the gradients in megatron's DDP, exactly as for the policy. A non-finite loss or gradient skips
  the step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rlbridge.batch import SeqBatch, ValueLossFn, pad_columns
from rlbridge.engines.base import load_named
from rlbridge.engines.megatron import build as B
from rlbridge.engines.megatron import compat, forward, params, state
from rlbridge.engines.megatron import provider as P
from rlbridge.engines.micro import scoring_passes
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import Recipe

HEAD = "output_layer."
"""Name prefix of the value head's tensors (it takes GPTModel's output_layer slot)."""


class ValueHead(nn.Linear):
    """float32 Linear(hidden, 1) in GPTModel's output_layer slot: called as output_layer(hidden, weight=...,
    runtime_gather_output=...), returns (values [s, b, 1], None). Stays float32 when the model is cast
    (megatron's Float16Module calls .bfloat16() / .half() on the whole model)."""

    def forward(  # type: ignore[override]  # megatron-core's GPTModel.forward, called with a subset of its arguments
        self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None, **_: Any
    ) -> tuple[Tensor, None]:
        return super().forward(hidden.float()), None

    def _apply(self, fn: Any, recurse: bool = True) -> ValueHead:
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self


class MegatronCritic:
    """Values of response tokens and critic updates on one rank (see the module docstring)."""

    padding_free = True
    """As MegatronTrainEngine.padding_free: rows grouped by length, each micro-batch at its rows' own widths."""

    def __init__(self, recipe: Recipe) -> None:
        compat.activate()
        B.check_backend(recipe)
        if recipe.trainer.bridge != "megatron-bridge":
            raise RlbridgeError(
                "PPO's critic on the megatron engine is built through Megatron-Bridge: set "
                "trainer.bridge: megatron-bridge"
            )
        self.recipe = recipe
        self.lr = float(recipe.algorithm.critic.lr)  # type: ignore[union-attr]  # a critic exists only under PPO: the algorithm is a PpoCfg
        self.num_optimizer_steps = 0
        self.max_tokens = recipe.trainer.max_tokens_per_micro_batch
        """As MegatronTrainEngine.max_tokens: training passes by this token budget."""
        seed = recipe.run.seed
        with compat.device_scope(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # adapters and head from run.seed, the global RNG untouched
            self.built = P.build(recipe)
            self.built.optim.lr = self.lr
            B.init_parallel(self.built.provider, seed)  # the policy's parallel state (sizes checked)
            hidden = int(self.built.provider.hidden_size)

            def value_head(chunks: list[nn.Module]) -> list[nn.Module]:
                for chunk in chunks:
                    if not hasattr(chunk, "output_layer"):
                        raise RlbridgeError(
                            "the critic needs the last pipeline stage (trainer.parallel.pipeline 1)"
                        )
                    head = ValueHead(hidden, 1, dtype=torch.float32, device=next(chunk.parameters()).device)
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(seed)
                        nn.init.normal_(head.weight, std=1.0 / (hidden + 1))  # as TRL / OpenRLHF value heads
                    nn.init.zeros_(head.bias)
                    chunk.output_layer = head
                return chunks

            self.bundle = B.build_megatron_bridge(self.built, after_peft=value_head)
            self.model: list[nn.Module] = self.bundle.chunks
            self.recompute_fix = B.ensure_recompute_input_fix(self.model, outside=(HEAD,))
            self.optimizer = B.build_optimizer(self.built, self.model)
            sets = params.param_sets(self.model, self.optimizer, self.bundle.at_wrap, recipe.lora.enabled)
            head_names = frozenset(n for n, _ in params.named_parameters(self.model) if n.startswith(HEAD))
            if recipe.lora.enabled:
                sets = params.ParamSets(
                    sets.at_wrap,
                    sets.trainable,
                    sets.optimizer,
                    sets.grad_buffers,
                    sets.adapters | head_names,
                )
            params.check_param_sets(sets)
        self._trainable = params.trainable(self.model)
        self.device = next(self.model[0].parameters()).device

    # --------------------------------------------------------------------------------- helpers
    def _split(
        self, batch: SeqBatch, num: int, *, training: bool = False, budget: bool = False
    ) -> list[forward.MicroBatch]:
        """As the policy's (no pipeline, context or sequence parallelism here: the recipe checks reject them)."""
        return forward.split_micro_batches(
            batch.to(self.device),
            num,
            seq_multiple=self.recipe.trainer.width_multiple(self.device.type),
            by_length=self.padding_free,
            max_tokens=self.max_tokens if training or budget else None,
        )

    @staticmethod
    def _values(output: Tensor, mb: forward.MicroBatch) -> Tensor:
        """[n, r] float32 values from the model's [m, S, 1] output (hidden states p - 1 .. p + r - 2, at the
        micro-batch's own widths)."""
        p, r, n = mb.prompt_width, mb.response_width, len(mb.rows)
        return output[:n, p - 1 : p + r - 1, 0].float()

    # ---------------------------------------------------------------------------------- values
    @torch.no_grad()
    def values(self, batch: SeqBatch) -> Tensor:
        """[b, R] float32 values of the response tokens (0 on padding), `trainer.logprob_chunk_size` rows
        per micro-batch, identical on every rank of the model-parallel group."""
        num, budget = scoring_passes(
            batch.size, self.built.run.logprob_chunk_size, self.built.run.micro_batch_size
        )

        def stage(output: Tensor, mb: forward.MicroBatch) -> tuple[Tensor, dict[str, Any]]:
            return output.new_zeros(()), {"values": self._values(output, mb)}

        with compat.device_scope(), forward.train_mode(self.model, False):
            mbs = self._split(batch, num, budget=budget)
            results = forward.run_schedule(self.model, mbs, stage, forward_only=True)
            parts = [r["values"] for r in results]
            out = forward.broadcast_from_last_stage(
                forward.batch_rows(parts, mbs, batch.size, batch.response_width) if results else None
            )
        mask = batch.response_mask.to(out.device) > 0
        return torch.where(mask, out.float(), torch.zeros((), dtype=torch.float32)).to(batch.input_ids.device)

    # -------------------------------------------------------------------------------- training
    def train_step(self, batch: SeqBatch, loss_fn: ValueLossFn, *, num_micro_batches: int) -> dict[str, Any]:
        """One critic optimizer step over `batch` in `num_micro_batches` row groups, or as many as the token
        budget needs (each pass backpropagates loss_fn(...) / num_micro_batches: forward.nominal_scale; DDP
        averages over data-parallel replicas). Metrics: the loss closure's (mean over the passes run),
        critic_grad_norm (before clipping), critic_skipped."""

        def stage(output: Tensor, mb: forward.MicroBatch) -> tuple[Tensor, dict[str, Any]]:
            values = pad_columns(self._values(output, mb), batch.response_width)  # the closure indexes [b, R]
            mask = batch.response_mask[mb.rows].to(values.device) > 0
            loss, metrics = loss_fn(torch.where(mask, values, torch.zeros((), dtype=values.dtype)), mb.rows)
            loss = loss * scale  # a new tensor: the schedule divides the returned loss in place
            reduced = {k: float(v) for k, v in metrics.items()}
            reduced["critic_loss"] = float(loss.detach())
            return loss, reduced

        with compat.device_scope(), forward.train_mode(self.model, True):
            self._zero_grads()
            mbs = self._split(batch, num_micro_batches, training=True)
            scale = forward.nominal_scale(len(mbs), num_micro_batches)
            results = forward.run_schedule(self.model, mbs, stage, forward_only=False)
            sums: dict[str, float] = {}
            for item in results:
                for k, v in item.items():
                    sums[k] = sums.get(k, 0.0) + float(v) / len(results)
            metrics = dict(forward.broadcast_from_last_stage(sums))
            bad_loss = not forward.finite(metrics.pop("critic_loss", 0.0))
            found_inf = bool(self.optimizer.prepare_grads())
            norm = float(self.optimizer.get_grad_norm())
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr
            out = {**metrics, "critic_grad_norm": norm, "critic_skipped": 0.0}
            if bad_loss or found_inf or not forward.finite(norm):
                self._zero_grads()
                return {**out, "critic_skipped": 1.0}
            forward.clip_and_step(self.optimizer, norm)
            self._zero_grads()
        self.num_optimizer_steps += 1
        return out

    def _zero_grads(self) -> None:
        forward.zero_grads(self.model, self.optimizer)

    # ------------------------------------------------------------------------------------ state
    def trainable_state(self) -> dict[str, Tensor]:
        """Copies of this rank's trainable tensors (adapters or the whole backbone, and the value head
        `output_layer.weight` / `output_layer.bias`), under Megatron names (local TP shards)."""
        return {n: p.detach().clone() for n, p in self._trainable}

    def load_trainable_state(self, tensors: dict[str, Tensor]) -> None:
        load_named(self._trainable, tensors, "the critic's trainable")
        self.optimizer.reload_model_params()

    def optimizer_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        raise RlbridgeError("the megatron critic is checkpointed through checkpoint_state (layout-free)")

    def load_optimizer_state(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        raise RlbridgeError("the megatron critic is restored through load_checkpoint_state (layout-free)")

    def checkpoint_state(self) -> tuple[dict[str, dict[str, Tensor]], dict[str, Any]]:
        """Collective: as MegatronTrainEngine.checkpoint_state, for the critic (value head included)."""
        with compat.device_scope():
            groups = state.gather_state(self.model, self.optimizer)
        return groups, {"format": state.FORMAT, "scheduler": {"step": self.num_optimizer_steps}}

    def load_checkpoint_state(self, groups: dict[str, dict[str, Tensor]], meta: dict[str, Any]) -> None:
        if meta.get("format") != state.FORMAT:
            raise RlbridgeError(f"unknown megatron critic checkpoint format {meta.get('format')!r}")
        with compat.device_scope():
            state.load_state(
                self.model, self.optimizer, groups["trainable"], groups.get("optimizer", {}), "the critic"
            )
        self.num_optimizer_steps = int(meta["scheduler"]["step"])

    def set_head(self, weight: Tensor, bias: Tensor) -> None:
        """Overwrite the value head (tests compare values against an HF computation with given weights)."""
        head = {n: p for n, p in self._trainable if n.startswith(HEAD)}
        with torch.no_grad():
            head[HEAD + "weight"].copy_(weight.reshape(head[HEAD + "weight"].shape))
            head[HEAD + "bias"].copy_(bias.reshape(head[HEAD + "bias"].shape))
        self.optimizer.reload_model_params()  # mixed precision keeps fp32 main copies

    def close(self) -> None:
        """Nothing to release: the parallel state belongs to the policy's engine."""
