"""PPO's critic on the hf engine: the policy's architecture from the same HF checkpoint, plus a value head.

Design: a *second model* in the trainer process, not a second adapter on the policy's model. The critic is
the checkpoint's backbone (transformers' AutoModel: the decoder without the output layer) with its own LoRA
adapter when lora.rank > 0 (the recipe's lora section: rank, alpha, targets, type) or fully trained when
lora.rank == 0, and a float32 `nn.Linear(hidden, 1)` value head. It has its own AdamW
(algorithm.critic.lr; betas, eps, weight decay and gradient clipping from trainer.optim; constant lr).

Why not a second adapter on the same base: peft routes every forward through the *active* adapter, so the
policy's log-probs, the reference log-probs (adapters disabled) and the merged export would all depend on
which adapter is active at the moment, and under full fine-tuning there is no shared frozen base at all.
Two models keep the parameters, gradients and optimizer states disjoint by construction, at the price of a
second copy of the (frozen, under LoRA) base weights, which rlbridge/plan/memory_estimate.py counts.

Token values follow advantages.gae's convention: `values[:, t]` is V(s_t), the value of the state before
response token t, read from the last hidden state at the position that predicts token t (P + t - 1, the
same positions whose logits give the log-prob of token t; engines/hf/token_stats.response_logits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlbridge.batch import SeqBatch, ValueLossFn, pad_columns
from rlbridge.engines.base import load_named, take_gradients
from rlbridge.engines.hf.master import MasterWeights
from rlbridge.engines.hf.model import attend_to_self
from rlbridge.engines.micro import forward_batch, micro_batch_rows, scoring_rows
from rlbridge.engines.optim import adamw_state, load_adamw_state
from rlbridge.model.hf import AutoModel, LoraConfig, PreTrainedModel, get_peft_model, hf_logging
from rlbridge.recipe.schema import Recipe
from rlbridge.recipe.targets import hf_targets

"""value_loss_fn(values_bt, rows) -> (loss, metrics); rows index the batch given to HFCritic.train_step."""


class HFCritic:
    """Values of response tokens and critic updates (see the module docstring)."""

    padding_free = True
    """As HFTrainEngine.padding_free: rows grouped by length, each forward at its rows' own widths."""

    @property
    def _max_tokens(self) -> int | None:
        return self.recipe.trainer.max_tokens_per_micro_batch

    @property
    def _width(self) -> int:
        """trainer.pass_width_multiple on this device."""
        return self.recipe.trainer.width_multiple(self.device.type)

    def __init__(self, recipe: Recipe, model_dir: Path, *, device: str = "cpu") -> None:
        self.recipe = recipe
        self.device = torch.device(device)
        self.num_optimizer_steps = 0
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "lm_head.weight not used": the backbone is all the critic needs
        try:
            backbone: PreTrainedModel = AutoModel.from_pretrained(
                model_dir, dtype=getattr(torch, recipe.model.dtype)
            )
        finally:
            hf_logging.set_verbosity(verbosity)
        nn.Module.to(backbone, self.device)
        attend_to_self(backbone)  # no fully masked query rows (engines/hf/model.py)
        hidden = int(backbone.config.hidden_size)
        with torch.random.fork_rng(devices=[]):  # adapter and head init from run.seed, global RNG untouched
            torch.manual_seed(recipe.run.seed)
            model: nn.Module = self._apply_lora(backbone) if recipe.lora.enabled else backbone
            head = nn.Linear(hidden, 1, dtype=torch.float32, device=self.device)
            nn.init.normal_(head.weight, std=1.0 / (hidden + 1))  # as TRL / OpenRLHF value heads
            nn.init.zeros_(head.bias)
        self._apply_recompute(backbone)
        self.module = nn.ModuleDict({"backbone": model, "value_head": head})
        # a bfloat16 / float16 backbone under full fine-tuning gets float32 masters, as the policy's
        self.master = MasterWeights([(n, p) for n, p in self.module.named_parameters() if p.requires_grad])
        self._trainable = self.master.named
        optim = recipe.trainer.optim
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self._trainable],
            lr=recipe.algorithm.critic.lr,  # type: ignore[union-attr]  # a critic exists only under PPO: the algorithm is a PpoCfg
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )

    def _apply_lora(self, backbone: PreTrainedModel) -> nn.Module:
        cfg = self.recipe.lora
        config = LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # peft's stubs are narrower than what it accepts
            lora_dropout=cfg.dropout,
            target_modules=hf_targets(cfg.targets),
            use_dora=cfg.type == "dora",
        )
        # float32 adapters on a bfloat16 / float16 backbone (peft's default, stated), as the policy's
        return get_peft_model(backbone, config, autocast_adapter_dtype=True)  # type: ignore[arg-type]  # peft's stubs are narrower than what it accepts

    def _apply_recompute(self, backbone: PreTrainedModel) -> None:
        """Whole-layer gradient checkpointing as the policy has it (engines/hf/engine.py), warnings left to the policy."""
        if self.recipe.trainer.recompute.granularity == "none":
            return
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.recipe.lora.enabled:
            backbone.enable_input_require_grads()

    # ------------------------------------------------------------------------------ values
    def _values(self, sub: SeqBatch) -> Tensor:
        """[b, R] float32 values V(s_t) of the response tokens from hidden states P - 1 .. P + R - 2."""
        out = self.module["backbone"](
            input_ids=sub.input_ids,
            attention_mask=sub.attention_mask,
            position_ids=sub.position_ids,
            use_cache=False,
        )
        p, r = sub.prompt_width, sub.response_width
        hidden = out.last_hidden_state[:, p - 1 : p + r - 1]
        return self.module["value_head"](hidden.float()).squeeze(-1)

    @torch.no_grad()
    def values(self, batch: SeqBatch) -> Tensor:
        """[b, R] float32 values of the response tokens (0 on padding), `trainer.logprob_chunk_size` rows
        per forward pass, on the batch's device."""
        self.module.eval()
        out = torch.zeros(batch.size, batch.response_width, device=batch.input_ids.device)
        for rows in scoring_rows(
            batch, self.recipe.trainer, by_length=self.padding_free, width_multiple=self._width
        ):
            out[rows.to(out.device)] = self._padded_values(batch, rows).to(out.device)
        return out

    def _padded_values(self, batch: SeqBatch, rows: Tensor) -> Tensor:
        """[len(rows), R] values of the rows (0 on padding), computed at the rows' own widths (padding_free)."""
        sub = forward_batch(
            batch,
            rows,
            self.device,
            trim=self.padding_free,
            width_multiple=self._width,
        )
        values = torch.where(sub.response_mask > 0, self._values(sub), 0.0)
        return pad_columns(values, batch.response_width)

    # ------------------------------------------------------------------------------ training
    def train_step(self, batch: SeqBatch, loss_fn: ValueLossFn, *, num_micro_batches: int) -> dict[str, Any]:
        """One critic optimizer step over `batch` in the same micro-batches as the policy's train_step
        (backpropagating loss_fn(...) / num_micro_batches each). A non-finite loss or gradient skips the step.
        Metrics (prefixed): the loss closure's, critic_grad_norm (before clipping), critic_skipped."""
        sums, bad = self._accumulate(batch, loss_fn, num_micro_batches)
        params = [p for _, p in self._trainable]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        out = {**sums, "critic_grad_norm": float(norm), "critic_skipped": 0.0}
        if bad or not bool(torch.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return {**out, "critic_skipped": 1.0}
        clip = self.recipe.trainer.optim.clip_grad
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.master.to_model()
        self.num_optimizer_steps += 1
        return out

    def gradients(
        self, batch: SeqBatch, loss_fn: ValueLossFn, *, num_micro_batches: int
    ) -> dict[str, Tensor]:
        """The accumulated gradient train_step would clip and apply, without stepping (tests, diagnostics)."""
        self._accumulate(batch, loss_fn, num_micro_batches)
        return take_gradients(self._trainable, self.optimizer)

    def _accumulate(
        self, batch: SeqBatch, loss_fn: ValueLossFn, num_micro_batches: int
    ) -> tuple[dict[str, float], bool]:
        """Forward/backward every micro-batch into .grad: the metrics' means over the passes run and whether a
        loss was not finite (it stops there)."""
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        done = 0
        for rows in micro_batch_rows(
            batch,
            num_micro_batches,
            by_length=self.padding_free,
            max_tokens=self._max_tokens,
            width_multiple=self._width,
        ):
            loss, metrics = loss_fn(self._padded_values(batch, rows), rows)
            if not bool(torch.isfinite(loss.detach())):
                return {k: v / max(done, 1) for k, v in sums.items()}, True
            (loss / num_micro_batches).backward()
            done += 1
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        return {k: v / done for k, v in sums.items()}, False

    # ---------------------------------------------------------------------- state for checkpoints
    def trainable_state(self) -> dict[str, Tensor]:
        """Copies of the critic's trainable tensors: its adapter (or whole backbone) and the value head."""
        return {n: p.detach().clone() for n, p in self._trainable}

    def load_trainable_state(self, tensors: dict[str, Tensor]) -> None:
        load_named(self._trainable, tensors, "the critic's trainable")
        self.master.to_model()

    def optimizer_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return adamw_state(self.optimizer, self._trainable, {"step": self.num_optimizer_steps})

    def load_optimizer_state(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        load_adamw_state(self.optimizer, self._trainable, tensors, meta)
        self.num_optimizer_steps = int(meta["scheduler"]["step"])
