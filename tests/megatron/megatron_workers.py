"""Worker functions run on N gloo ranks by launcher.py; each returns plain data (tensors, floats, strings).

HF-side references are computed by the tests themselves (in the pytest process), so a worker only reports
what the megatron engine produced.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rlbridge.batch import SeqBatch
from rlbridge.recipe.schema import Recipe

# ------------------------------------------------------------------------------------------ recipes


def make_recipe(model_dir: str, **sections: Any) -> Recipe:
    raw: dict[str, Any] = {
        "name": "megatron-test",
        "model": {"path": model_dir, "dtype": "float32"},
        "trainer": {"engine": "megatron", "optim": {"lr": 1e-2, "clip_grad": None}},
        "reward": {"fn": "arithmetic"},
        "data": {"train": {"path": "unused.jsonl"}},
        "run": {"seed": 3, "steps": 10},
        # mean_logprob_loss's entropy bonus is trained (entropy_coef 0 would make the engine's entropy a metric)
        "algorithm": {"entropy_coef": 0.01},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return Recipe.model_validate(raw)


def lora(rank: int = 4, alpha: float = 8.0, type_: str = "lora") -> dict[str, Any]:
    return {"rank": rank, "alpha": alpha, "type": type_}


def trainer(tp: int = 1, pp: int = 1, vpp: int | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "engine": "megatron",
        "optim": {"lr": 1e-2, "clip_grad": None},
        "parallel": {"tensor": tp, "pipeline": pp, "virtual_pipeline": vpp},
        "logprob_chunk_size": 2,
        "micro_batch_size": 3,
        **extra,
    }


STEP_OPTIM = {"lr": 1e-2, "clip_grad": None, "eps": 1e-4}
"""The optimizer of the runs whose weights after two Adam steps are compared across layouts (tp1_lora_suite,
layout_suite). With Adam's default eps (1e-8) an entry whose gradient is ~0 moves by ~lr in the direction of its
float noise: a TP2 x PP2 run and the TP1 run (gradients equal to 1.5e-7) then differed by 1.6e-4 in one merged
weight on one CPU model (4.6e-6 on another). eps 1e-4 makes the step of such an entry proportional to its gradient,
so summation-order noise stays noise-sized; it changes nothing the tests compare otherwise."""


def ragged_batch(seed: int = 0, rows: int = 5, vocab: int = 256) -> SeqBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(rows):
        p = int(torch.randint(2, 9, (1,), generator=g))
        r = int(torch.randint(1, 7, (1,), generator=g)) if i != 1 else 6
        prompts.append(torch.randint(1, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(1, vocab, (r,), generator=g).tolist())
    return SeqBatch.from_token_lists(prompts, responses, pad_id=0)


def full_batch(seed: int = 1, rows: int = 2, seq: int = 16, vocab: int = 256) -> SeqBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    return SeqBatch.from_token_lists(ids[:, :1].tolist(), ids[:, 1:].tolist(), pad_id=0)


def batch_dict(batch: SeqBatch) -> dict[str, Any]:
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "response_mask": batch.response_mask,
        "prompt_width": batch.prompt_width,
    }


def mean_logprob_loss(
    batch: SeqBatch,
    entropy_coef: float = 0.01,
    seen: dict | None = None,
    *,
    shares: int = 2,
    tokens: float | None = None,
) -> Any:
    """A loss that reaches every adapter: -mean log-prob of response tokens - coef * mean entropy over the
    `tokens` real response tokens (default: those of `batch`). Each call returns its micro-batch's share times
    `shares` (the micro-batches the engine divides by, times the data-parallel replicas DDP averages over),
    as rlbridge.algo.objective's closures do: the gradient is then the same for any grouping of the rows into
    micro-batches (index order at PP > 1, by length at PP = 1) or replicas. With `seen`, records the
    entropies it was handed (row index -> [R] tensor)."""
    total = float(batch.response_mask.sum()) if tokens is None else tokens

    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if seen is not None:
            for i, row in enumerate(rows.tolist()):
                seen[row] = entropy[i].detach().cpu()
        mask = batch.response_mask[rows].to(logp.device)
        n = mask.sum().clamp(min=1)
        loss = (-(logp * mask).sum() - entropy_coef * (entropy * mask).sum()) * shares / total
        return loss, {"mean_logp": float((logp.detach() * mask).sum() / n)}

    return loss_fn


# ------------------------------------------------------------------------------------------ helpers
def full_logits(engine: Any, batch: SeqBatch) -> torch.Tensor:
    """[b, S, vocab] logits gathered over TP, from the last pipeline stage, on every rank."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlbridge.engines.megatron import compat, forward

    def stage(output: torch.Tensor, mb: forward.MicroBatch) -> tuple[torch.Tensor, dict]:
        return output.new_zeros(()), {"logits": gather_from_tensor_model_parallel_region(output).detach()}

    padding_free, engine.padding_free = engine.padding_free, False  # one micro-batch at the batch's width
    forward.response_head(engine.model, on=False)  # the output layer on every position
    try:
        with torch.no_grad(), compat.device_scope(), forward.train_mode(engine.model, False):
            mbs = engine._split(batch, 1)
            results = forward.run_schedule(engine.model, mbs, stage, forward_only=True)
            out = results[0]["logits"][: batch.size] if results else None
            return forward.broadcast_from_last_stage(out)
    finally:
        engine.padding_free = padding_free
        forward.response_head(engine.model)


def _global_layer(engine: Any, chunk_index: int, local_index: int) -> int:
    from megatron.core.utils import unwrap_model

    chunk = unwrap_model(engine.model[chunk_index])
    return int(chunk.decoder.layers[local_index].layer_number) - 1


def set_adapters(engine: Any, seed: int = 11, scale: float = 0.05) -> None:
    """Layout-independent adapter values: each full tensor (megatron TP=1 layout) is drawn from a generator
    keyed by (global layer, module, in/out), then cut into this rank's TP shard."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in engine._trainable:
        chunk_index = 0
        local = name
        if name.startswith("chunk"):
            head, local = name.split(".", 1)
            chunk_index = int(head[len("chunk") :])
        parts = local.split(".")
        layer = _global_layer(engine, chunk_index, int(parts[2]))
        key = f"{seed}|{layer}|{'.'.join(parts[3:])}"
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        split = bool(getattr(p, "tensor_model_parallel", False)) and tp > 1
        dim = int(getattr(p, "partition_dim", 0))
        shape = list(p.shape)
        if split:
            shape[dim] *= tp
        full = torch.randn(shape, generator=g) * scale
        if not split:
            shard = full
        elif "linear_fc1.adapter.linear_out" in local and dim == 0:  # gate/up halves, each cut by TP
            shard = torch.cat([half.chunk(tp, 0)[rank] for half in full.chunk(2, 0)])
        else:
            shard = full.chunk(tp, dim)[rank]
        with torch.no_grad():
            p.copy_(shard.to(p.dtype))
    engine.optimizer.reload_model_params()


def grads_in_hf_names(
    engine: Any, batch: SeqBatch, num_micro_batches: int = 2, loss: Any = None
) -> dict[str, torch.Tensor]:
    """First-step adapter gradients (of `loss`, default mean_logprob_loss(batch)), converted to HF/PEFT names
    and full shapes by the bridge's adapter exporter (a pure re-arrangement, so it maps gradients as it maps
    weights)."""
    loss = mean_logprob_loss(batch, shares=num_micro_batches) if loss is None else loss
    grads = engine.gradients(batch, loss, num_micro_batches=num_micro_batches)
    saved = {n: p.detach().clone() for n, p in engine._trainable}
    with torch.no_grad():
        for n, p in engine._trainable:
            p.copy_(grads[n])
    try:
        out = engine.export_weights("adapter").tensors
    finally:
        with torch.no_grad():
            for n, p in engine._trainable:
                p.copy_(saved[n])
    return out


# ------------------------------------------------------------------------------------------ workers
def provider_rows(model_dir: str, recipes: list[dict[str, Any]]) -> dict[str, Any]:
    """For each recipe: every table row's (expected, actual), the PEFT object's fields, backend settings."""
    from rlbridge.engines.megatron import provider as P

    out: list[dict[str, Any]] = []
    for raw in recipes:
        recipe = make_recipe(model_dir, **raw)
        built = P.build(recipe)
        rows = []
        for row in P.TABLE:
            obj, attr = row.target.split(".", 1)
            expected = row.convert(P.recipe_value(recipe, row.key), recipe)
            actual = getattr(built.target(obj), attr)
            rows.append(
                {
                    "key": row.key,
                    "target": row.target,
                    "expected": repr(expected),
                    "actual": repr(actual),
                    "equal": bool(expected == actual),
                }
            )
        peft = built.peft
        out.append(
            {
                "rows": rows,
                "peft_class": type(peft).__name__ if peft is not None else None,
                "peft_fields": {
                    f: repr(getattr(peft, f)) for f in ("dim", "alpha", "dropout", "target_modules")
                }
                if peft
                else {},
                "peft_settings": {
                    f: repr(getattr(built.peft_settings, f))
                    for f in ("dim", "alpha", "dropout", "target_modules")
                },
                "fusions": {f: getattr(built.provider, f, None) for f in P.FUSIONS_OFF},
                "layer_spec": getattr(built.provider.transformer_layer_spec, "__name__", ""),
                "cpu_init": bool(built.provider.use_cpu_initialization),
            }
        )
    import importlib.util

    import megatron.bridge.peft.module_matcher as matcher
    import megatron.bridge.peft.utils as peft_utils

    from rlbridge.engines.megatron import compat

    return {
        "recipes": out,
        "te_importable": importlib.util.find_spec("transformer_engine") is not None,
        "have_te_flags": [peft_utils.HAVE_TE, matcher.HAVE_TE],
        "versions": compat.versions(),
        "features": repr(compat.features()),
        "cuda_type_outside_scope": torch.zeros(1).type(),
    }


def tp1_lora_suite(qwen: str) -> dict[str, Any]:
    """TP1/PP1 LoRA on the tiny Qwen2: logits, parameter sets, log-probs (ragged), reference log-probs,
    first-step gradients (HF names), two training steps, merged + adapter export, logits after."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    engine = MegatronTrainEngine(make_recipe(qwen, lora=lora(), trainer=trainer(optim=STEP_OPTIM)))
    full = full_batch()
    ragged = ragged_batch()
    res: dict[str, Any] = {
        "batch_full": batch_dict(full),
        "logits_init": full_logits(engine, full),
        "batch_ragged": batch_dict(ragged),
    }
    sets = engine.param_sets
    res["sets"] = {
        k: sorted(getattr(sets, k)) for k in ("at_wrap", "trainable", "optimizer", "grad_buffers", "adapters")
    }
    res["frozen_before"] = engine.frozen_fingerprint()
    res["logprobs_init"] = engine.logprobs(ragged)
    set_adapters(engine)
    res["grads_hf"] = grads_in_hf_names(engine, ragged)
    res["logprobs_adapters"] = engine.logprobs(ragged)
    res["logprobs_reference"] = engine.logprobs(ragged, reference=True)
    before = engine.trainable_state()
    res["steps"] = [
        engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2) for _ in range(2)
    ]
    after = engine.trainable_state()
    res["changed"] = {n: bool(not torch.equal(before[n], after[n])) for n in before}
    res["frozen_after"] = engine.frozen_fingerprint()
    res["logprobs_trained"] = engine.logprobs(ragged)
    res["logprobs_reference_trained"] = engine.logprobs(ragged, reference=True)
    res["logits_trained"] = full_logits(engine, full)
    res["merged"] = engine.export_weights("merged").tensors
    adapter = engine.export_weights("adapter")
    res["adapter"], res["adapter_config"] = adapter.tensors, adapter.adapter_config
    return res


def recompute_suite(qwen: str) -> dict[str, Any]:
    """LoRA first-step gradients without recompute, with full recompute (uniform and block), and with the
    recompute-input fix removed (to show the test would catch the bug)."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    batch = ragged_batch()
    loss = mean_logprob_loss(batch)
    out: dict[str, Any] = {}
    start: dict[str, torch.Tensor] = {}
    runs = {
        "plain": {"granularity": "none"},
        "uniform": {"granularity": "full", "method": "uniform", "num_layers": 1},
        "block": {"granularity": "full", "method": "block", "num_layers": 4},
        "unfixed": {"granularity": "full", "method": "uniform", "num_layers": 1},
    }
    for label, recompute in runs.items():
        engine = MegatronTrainEngine(make_recipe(qwen, lora=lora(), trainer=trainer(recompute=recompute)))
        if not start:
            set_adapters(engine)
            start = engine.trainable_state()
        engine.load_trainable_state(start)
        out[f"{label}_fix"] = engine.recompute_fix
        if label == "unfixed":
            from megatron.core.transformer.transformer_block import TransformerBlock

            for chunk in engine.model:
                for module in chunk.modules():
                    if isinstance(module, TransformerBlock):
                        module.__dict__.pop("forward", None)
        out[label] = engine.gradients(batch, loss, num_micro_batches=2)
        engine.close()
    return out


def tied_llama_suite(llama: str) -> dict[str, Any]:
    """Tied embeddings (Llama): LoRA at TP1 (export names, logits), then full fine-tuning with a reference
    copy (kl.coef > 0): train, merged export, reference log-probs."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    full, ragged = full_batch(), ragged_batch()
    res: dict[str, Any] = {"batch_full": batch_dict(full), "batch_ragged": batch_dict(ragged)}
    engine = MegatronTrainEngine(make_recipe(llama, lora=lora(), trainer=trainer()))
    res["lora_logits_init"] = full_logits(engine, full)
    set_adapters(engine)
    engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2)
    res["lora_logits"] = full_logits(engine, full)
    res["lora_merged"] = engine.export_weights("merged").tensors
    engine.close()
    recipe = make_recipe(
        llama,
        trainer=trainer(optim={"lr": 1e-3, "clip_grad": 1.0}),
        algorithm={"name": "grpo", "kl": {"coef": 0.01}},
    )
    engine = MegatronTrainEngine(recipe)
    res["full_sets"] = {
        k: len(getattr(engine.param_sets, k)) for k in ("trainable", "optimizer", "grad_buffers", "adapters")
    }
    res["full_frozen"] = engine.frozen_fingerprint()
    res["full_steps"] = [
        engine.train_step(ragged, mean_logprob_loss(ragged, shares=3), num_micro_batches=3) for _ in range(2)
    ]
    res["full_logits"] = full_logits(engine, full)
    res["full_merged"] = engine.export_weights("merged").tensors
    res["full_reference"] = engine.logprobs(ragged, reference=True)
    res["full_logprobs"] = engine.logprobs(ragged)
    engine.close()
    return res


def mbridge_suite(qwen: str, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """trainer.bridge=mbridge, full fine-tuning: logits, two steps, merged export."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    full, ragged = full_batch(), ragged_batch()
    engine = MegatronTrainEngine(
        make_recipe(
            qwen, trainer=trainer(tp=tp, pp=pp, bridge="mbridge", optim={"lr": 1e-3, "clip_grad": 1.0})
        )
    )
    res: dict[str, Any] = {"batch_full": batch_dict(full), "logits_init": full_logits(engine, full)}
    res["sets"] = {
        k: len(getattr(engine.param_sets, k))
        for k in ("at_wrap", "trainable", "optimizer", "grad_buffers", "adapters")
    }
    res["steps"] = [
        engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2) for _ in range(2)
    ]
    res["logits"] = full_logits(engine, full)
    res["merged"] = engine.export_weights("merged").tensors
    engine.close()
    return res


def _pp_duplicate_check() -> dict[str, str]:
    """The patched broadcast_from_pp_rank: identical copies on every stage pass, differing copies fail."""
    from megatron.bridge.models.conversion.param_mapping import DirectMapping
    from megatron.core import parallel_state as ps

    mapping = DirectMapping("decoder.dup.weight", "model.dup.weight")
    same = torch.arange(6.0, device="cuda" if torch.cuda.is_available() else "cpu").reshape(2, 3)
    out = {"identical": "ok" if torch.equal(mapping.broadcast_from_pp_rank(same.clone()), same) else "wrong"}
    differing = same + ps.get_pipeline_model_parallel_rank()
    try:
        DirectMapping("decoder.dup2.weight", "model.dup2.weight").broadcast_from_pp_rank(differing)
        out["differing"] = "accepted"
    except ValueError as e:
        out["differing"] = str(e)
    return out


def layout_suite(
    qwen: str, tp: int, pp: int, vpp: int | None = None, export: bool = False, dtype: str = "float32"
) -> dict[str, Any]:
    """LoRA at a TP x PP (x VPP) layout: logits, log-probs, first-step gradients in HF names, per-rank
    parameter sets and, with export, two steps then merged + adapter export and the trainer's logits."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    recipe = make_recipe(
        qwen, model={"dtype": dtype}, lora=lora(), trainer=trainer(tp=tp, pp=pp, vpp=vpp, optim=STEP_OPTIM)
    )
    engine = MegatronTrainEngine(recipe)
    full, ragged = full_batch(), ragged_batch()
    sets = engine.param_sets
    res: dict[str, Any] = {
        "batch_full": batch_dict(full),
        "logits_init": full_logits(engine, full),
        "logprobs_init": engine.logprobs(ragged),
        "sets_equal": all(
            getattr(sets, k) == sets.adapters for k in ("at_wrap", "trainable", "optimizer", "grad_buffers")
        ),
        "num_adapters": len(sets.adapters),
        "local_params": sum(p.numel() for _, p in engine._trainable),
    }
    seen: dict[int, torch.Tensor] = {}  # entropies handed to loss_fn, with the adapters still a no-op
    engine.gradients(ragged, mean_logprob_loss(ragged, seen=seen), num_micro_batches=2)
    res["entropy"] = torch.stack([seen[i] for i in sorted(seen)]) if seen else None
    set_adapters(engine)
    local = engine.gradients(ragged, mean_logprob_loss(ragged), num_micro_batches=2)
    res["local_grads_nonzero"] = sum(float(g.abs().sum()) > 0 for g in local.values()) == len(local) > 0
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if dp == 1:
        res["grads_hf"] = grads_in_hf_names(engine, ragged)
    else:  # each replica gets its tensor_split share as one micro-batch: DDP averages dp shares of the loss
        mine = ragged.select(torch.arange(ragged.size).tensor_split(dp)[dp_rank])
        share = mean_logprob_loss(mine, shares=dp, tokens=float(ragged.response_mask.sum()))
        res["grads_hf"] = grads_in_hf_names(engine, mine, num_micro_batches=1, loss=share)
    if pp > 1:
        res["pp_duplicates"] = _pp_duplicate_check()
    if export:
        res["steps"] = [
            engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2) for _ in range(2)
        ]
        res["logits_trained"] = full_logits(engine, full)
        res["merged"] = engine.export_weights("merged").tensors
        adapter = engine.export_weights("adapter")
        res["adapter"], res["adapter_config"] = adapter.tensors, adapter.adapter_config
    engine.close()
    return res


def variants_suite(qwen: str) -> dict[str, Any]:
    """canonical LoRA (train, merged + adapter export), DoRA (train, reference, export refused) and a step
    with a non-finite loss (skipped, named, weights untouched), all at TP1."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine
    from rlbridge.errors import RlbridgeError

    full, ragged = full_batch(), ragged_batch()
    res: dict[str, Any] = {"batch_full": batch_dict(full), "batch_ragged": batch_dict(ragged)}
    engine = MegatronTrainEngine(make_recipe(qwen, lora=lora(type_="canonical_lora"), trainer=trainer()))
    res["canonical_init"] = full_logits(engine, full)
    res["canonical_num_adapters"] = len(engine.param_sets.adapters)
    set_adapters(engine)
    res["canonical_steps"] = [
        engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2) for _ in range(2)
    ]
    res["canonical_logits"] = full_logits(engine, full)
    res["canonical_merged"] = engine.export_weights("merged").tensors
    adapter = engine.export_weights("adapter")
    res["canonical_adapter"], res["canonical_config"] = adapter.tensors, adapter.adapter_config
    engine.close()

    engine = MegatronTrainEngine(make_recipe(qwen, lora=lora(type_="dora"), trainer=trainer()))
    before = engine.trainable_state()
    res["dora_steps"] = [
        engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2) for _ in range(2)
    ]
    after = engine.trainable_state()
    res["dora_changed"] = sum(not torch.equal(before[n], after[n]) for n in before) / len(before)
    res["dora_reference"] = engine.logprobs(ragged, reference=True)
    res["dora_logprobs"] = engine.logprobs(ragged)
    try:
        engine.export_weights("merged")
        res["dora_export"] = "exported"
    except RlbridgeError as e:
        res["dora_export"] = str(e)
    engine.close()

    engine = MegatronTrainEngine(make_recipe(qwen, lora=lora(), trainer=trainer()))
    set_adapters(engine)
    before = engine.trainable_state()

    def nan_loss(logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return logp.sum() * float("nan"), {}

    res["nan_step"] = engine.train_step(ragged, nan_loss, num_micro_batches=2)
    res["nan_unchanged"] = all(torch.equal(before[n], t) for n, t in engine.trainable_state().items())
    res["after_nan_step"] = engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2)
    engine.close()
    return res


def provider_rope(model_dir: str) -> dict[str, float]:
    """The rotary base the provider gets for a model with a non-default rope_theta."""
    from rlbridge.engines.megatron import provider as P

    return {"rotary_base": float(P.build(make_recipe(model_dir)).provider.rotary_base)}


def role_update_suite(qwen: str) -> dict[str, Any]:
    """TrainerRole on the megatron engine (the per-rank role of TrainerGroup), data parallel = world size:
    one off-policy GRPO step of two mini-batches on a fixed batch; log-prob shares, metrics, adapters after."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine
    from rlbridge.trainer.role import TrainerRole

    recipe = make_recipe(
        qwen, lora=lora(), trainer=trainer(micro_batch_size=1), rollout={"n": 2},
        data={"train": {"path": "unused.jsonl"}, "batch_size": 4, "mini_batch_size": 2},
    )  # fmt: skip
    role = TrainerRole(recipe, qwen, engine_factory=lambda: MegatronTrainEngine(recipe))
    set_adapters(role.engine)
    batch = ragged_batch(seed=4, rows=8)
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(8, 1, generator=g).expand(8, batch.response_width) * batch.response_mask
    rollout = role.engine.logprobs(batch) + 0.01 * batch.response_mask
    res = {"logprobs_share": role.logprobs(batch), "dp": role.dp_size}
    res["metrics"] = role.update(batch, adv, rollout, None)
    res["after"] = role.engine.trainable_state()
    role.engine.close()  # type: ignore[attr-defined]
    return res


def critic_suite(
    qwen: str,
    tp: int = 1,
    rank: int = 4,
    dtype: str = "float32",
    ckpt_out: str | None = None,
    ckpt_in: str | None = None,
) -> dict[str, Any]:
    """PPO's megatron critic next to the policy engine (as in a TrainerRole): values with a given head,
    one critic step (the head's gradient captured before the optimizer applies it), and the policy's
    log-probs before and after (the critic must not touch the policy). `ckpt_out`: then checkpoint the critic
    there (its layout-free state after step 1, as TrainerRole writes it) and take step 2 (`step2`); `ckpt_in`
    (or `ckpt_out`): then restore that checkpoint and take step 2 from it (`resumed2`)."""
    from rlbridge.algo.objective import make_value_loss_fn
    from rlbridge.engines.megatron import params
    from rlbridge.engines.megatron.critic import HEAD, MegatronCritic
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    recipe = make_recipe(
        qwen,
        model={"dtype": dtype},
        lora=lora(rank) if rank else {"rank": 0},
        trainer=trainer(tp=tp),
        algorithm={"name": "ppo", "critic": {"lr": 1e-2, "value_clip": 0.2}},
    )
    engine = MegatronTrainEngine(recipe)
    batch = ragged_batch()
    policy_before = engine.logprobs(batch)
    critic = MegatronCritic(recipe)
    g = torch.Generator().manual_seed(5)
    hidden = int(critic.built.provider.hidden_size)
    weight, bias = torch.randn(1, hidden, generator=g) * 0.2, torch.tensor([0.3])
    critic.set_head(weight, bias)
    values = critic.values(batch)
    returns = torch.randn(values.shape, generator=g) * batch.response_mask
    value_fn = make_value_loss_fn(
        recipe.algorithm.critic,
        values,
        returns,
        batch.response_mask,  # type: ignore[arg-type]
        micro_scale=2.0,
    )
    grads: dict[str, torch.Tensor] = {}
    apply = critic.optimizer.step_with_ready_grads

    def capture() -> Any:
        for name, p in critic._trainable:
            if name.startswith(HEAD):
                grads[name] = params.main_grad(p).detach().clone()  # type: ignore[union-attr]
        return apply()

    critic.optimizer.step_with_ready_grads = capture  # type: ignore[method-assign]
    metrics = critic.train_step(batch, value_fn, num_micro_batches=2)
    critic.optimizer.step_with_ready_grads = apply  # type: ignore[method-assign]
    res = {
        "batch": batch_dict(batch),
        "weight": weight,
        "bias": bias,
        "values": values,
        "head_grads": grads,
        "metrics": metrics,
        "values_after": critic.values(batch),
        "policy_before": policy_before,
        "policy_after": engine.logprobs(batch),
        "trainable": sorted(critic.trainable_state()),
        "dtypes": {n: str(p.dtype) for n, p in critic._trainable},
    }
    return {**res, **_critic_checkpoint_steps(critic, batch, value_fn, ckpt_out, ckpt_in)}


def _critic_checkpoint_steps(
    critic: Any, batch: SeqBatch, value_fn: Any, ckpt_out: str | None, ckpt_in: str | None
) -> dict[str, Any]:
    """See critic_suite: the critic's step 2 taken on, and taken again from a checkpoint of step 1."""
    from rlbridge.run import checkpoint as ckpt

    out: dict[str, Any] = {}

    def step2() -> dict[str, Any]:
        metrics = critic.train_step(batch, value_fn, num_micro_batches=2)
        return {"metrics": metrics, "values": critic.values(batch), "state": critic.checkpoint_state()[0]}

    if ckpt_out is not None:
        groups, meta = critic.checkpoint_state()
        if torch.distributed.get_rank() == 0:
            tensors = {"critic": groups["trainable"], "critic_optimizer": groups["optimizer"]}
            ckpt.save_checkpoint(
                Path(ckpt_out), 1, tensors=tensors, state={"meta": meta}, recipe_yaml="", keep=1
            )
        torch.distributed.barrier()
        out["step2"] = step2()
    source = ckpt_in or ckpt_out
    if source is not None:
        loaded = ckpt.load_checkpoint(Path(source) / ckpt.CHECKPOINTS / ckpt.step_dir_name(1))
        groups = {"trainable": loaded.tensors["critic"], "optimizer": loaded.tensors["critic_optimizer"]}
        critic.load_checkpoint_state(groups, loaded.state["meta"])
        out["resumed2"] = step2()
    return out


def role_ppo_update_suite(qwen: str) -> dict[str, Any]:
    """role_update_suite with PPO: the critic's value shares (data parallel = world size) and one update of
    policy and critic (two mini-batches); the critic's trainable tensors after."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine
    from rlbridge.trainer.role import TrainerRole

    recipe = make_recipe(
        qwen, lora=lora(), trainer=trainer(micro_batch_size=1), rollout={"n": 2},
        data={"train": {"path": "unused.jsonl"}, "batch_size": 4, "mini_batch_size": 2},
        algorithm={"name": "ppo", "critic": {"lr": 1e-2, "value_clip": 0.2}},
    )  # fmt: skip
    role = TrainerRole(recipe, qwen, engine_factory=lambda: MegatronTrainEngine(recipe))
    batch = ragged_batch(seed=4, rows=8)
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(8, 1, generator=g).expand(8, batch.response_width) * batch.response_mask
    returns = torch.randn(8, batch.response_width, generator=g) * batch.response_mask
    rollout = role.engine.logprobs(batch) + 0.01 * batch.response_mask
    share = role.values(batch)
    old_values = role.critic.values(batch)  # type: ignore[union-attr]  # the full batch, as the driver would have it
    res = {"values_share": share, "values": old_values, "dp": role.dp_size}
    res["metrics"] = role.update(batch, adv, rollout, None, old_values, returns)
    res["critic_after"] = role.critic.trainable_state()  # type: ignore[union-attr]
    role.engine.close()  # type: ignore[attr-defined]
    return res


def _main_params(engine: Any) -> dict[str, torch.Tensor]:
    """The parameters megatron-core's optimizer steps, by trainable name: the float32 main copy of each 16-bit
    model parameter (Float16OptimizerWithFloat16Params), the parameter itself where there is none."""
    mains: dict[int, torch.Tensor] = {}
    for sub in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for model_group, main_group in zip(
            getattr(sub, "float16_groups", []), getattr(sub, "fp32_from_float16_groups", []), strict=True
        ):
            mains.update({id(p): m for p, m in zip(model_group, main_group, strict=True)})
    return {n: mains.get(id(p), p) for n, p in engine._trainable}


def precision_suite(qwen: str, dtype: str = "bfloat16", rank: int = 0, lr: float = 1e-4) -> dict[str, Any]:
    """The megatron engine's numerics for `model.dtype`: which optimizers megatron-core built, the dtypes of the
    model's trainable weights, of the optimizer's main weights and Adam moments, log-probs of a ragged batch,
    and the main weights before / after three steps of a tiny lr (full fine-tuning by default)."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    engine = MegatronTrainEngine(
        make_recipe(
            qwen,
            model={"dtype": dtype},
            lora=lora(rank) if rank else {"rank": 0},
            trainer=trainer(optim={"lr": lr, "clip_grad": None}),
        )
    )
    ragged = ragged_batch()
    subs = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    from megatron.core.utils import unwrap_model

    layer = unwrap_model(engine.model)[-1].output_layer
    weight = layer.weight.detach()
    hidden = (torch.randn(3, 2, weight.shape[1], generator=torch.Generator().manual_seed(0)) * 2).to(
        weight.dtype
    )
    with torch.no_grad():
        head_out = layer(hidden)[0]
    res_head = {
        "head_dtype": str(head_out.dtype),
        "head_out": head_out.detach().float(),
        "head_exact": hidden.double() @ weight.double().T,
    }
    res: dict[str, Any] = {
        **res_head,
        "optimizers": [type(s).__name__ for s in subs],
        "model_dtypes": sorted({str(p.dtype) for _, p in engine._trainable}),
        "batch_ragged": batch_dict(ragged),
        "logprobs": engine.logprobs(ragged),
        "main_before": {n: m.detach().clone() for n, m in _main_params(engine).items()},
    }
    res["steps"] = [
        engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2) for _ in range(3)
    ]
    mains = _main_params(engine)
    res["main_after"] = {n: m.detach().clone() for n, m in mains.items()}
    states = [s.optimizer.state[m] for s in subs for m in mains.values() if m in s.optimizer.state]
    res["num_states"] = len(states)
    res["moment_dtypes"] = sorted({str(st[k].dtype) for st in states for k in ("exp_avg", "exp_avg_sq")})
    engine.close()
    return res


def checkpoint_suite(
    qwen: str,
    run_dir: str,
    tp: int,
    pp: int,
    phase: str,
    lr: float = 1e-2,
    warmup: int = 0,
    full_ft_dir: str | None = None,
    save_step3: str | None = None,
    load_step3: str | None = None,
    vpp: int | None = None,
) -> dict[str, Any]:
    """Checkpoints through TrainerRole on the megatron engine (issue 15). phase "save": two Adam steps, save
    checkpoint step 2, then a third step; phase "load": restore step 2 at this (possibly other) layout and
    take the third step. Both report the full canonical state (global rank 0) and log-probs after step 3,
    so a resume at any layout can be compared with continuing at the original one. Then `save_step3`: save
    step 3 into that run directory and take a fourth step (`step4`: what a resume of it must reproduce);
    `load_step3`: restore step 3 of that run directory and take the fourth step (`resumed4`). `full_ft_dir`:
    then a full fine-tuning run at the same layout saves there too (`full_ft_checkpoint`, under "full_ft"; one
    launch for both). `vpp`: virtual pipeline stages per pipeline rank (None: none)."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine
    from rlbridge.trainer.role import TrainerRole

    recipe = make_recipe(
        qwen,
        lora=lora(),
        trainer=trainer(tp=tp, pp=pp, vpp=vpp, optim={"lr": lr, "clip_grad": 1.0, "warmup_steps": warmup}),
    )
    role = TrainerRole(recipe, qwen, engine_factory=lambda: MegatronTrainEngine(recipe))
    role.is_holder = torch.distributed.get_rank() == 0
    engine: Any = role.engine
    batch = ragged_batch(seed=4, rows=4)
    res: dict[str, Any] = {"support": role.checkpoint_support()}
    if phase == "save":
        set_adapters(engine)
        res["steps"] = [
            engine.train_step(batch, mean_logprob_loss(batch), num_micro_batches=2) for _ in range(2)
        ]
        import time

        t0 = time.perf_counter()
        from rlbridge.run.directory import resolved_yaml

        res["saved"] = asdict(
            role.save_checkpoint(run_dir, 2, {"note": "test"}, resolved_yaml(recipe), keep=2)
        )
        res["save_s"] = time.perf_counter() - t0
        res["batch_full"] = batch_dict(full_batch())
        res["logits_saved"] = full_logits(engine, full_batch())  # what export-hf of step 2 must reproduce
    else:
        import time

        t0 = time.perf_counter()
        res["state"] = role.load_checkpoint(f"{run_dir}/checkpoints/step_000002")
        res["load_s"] = time.perf_counter() - t0
        res["loaded"] = engine.checkpoint_state()[0]
    res["step3"] = engine.train_step(batch, mean_logprob_loss(batch), num_micro_batches=2)
    res["logprobs"] = engine.logprobs(batch)
    groups, meta = engine.checkpoint_state()
    res["after"], res["meta"] = groups, meta
    if save_step3 is not None or load_step3 is not None:
        from rlbridge.run.directory import resolved_yaml

        if save_step3 is not None:
            res["saved3"] = asdict(
                role.save_checkpoint(save_step3, 3, {"note": "step3"}, resolved_yaml(recipe), keep=1)
            )
        else:
            res["state3"] = role.load_checkpoint(f"{load_step3}/checkpoints/step_000003")
        step4 = engine.train_step(batch, mean_logprob_loss(batch), num_micro_batches=2)
        res["step4" if save_step3 is not None else "resumed4"] = {
            "step": step4,
            "logprobs": engine.logprobs(batch),
            "after": engine.checkpoint_state()[0],
        }
    engine.close()
    if full_ft_dir is not None:
        res["full_ft"] = full_ft_checkpoint(qwen, full_ft_dir, tp, pp)
    return res


def moe_suite(
    model: str,
    tp: int = 1,
    ep: int = 1,
    train: bool = True,
    detach_expert: int | None = None,
    grads: bool = False,
    run_dir: str | None = None,
    resume: str | None = None,
) -> dict[str, Any]:
    """The tiny Qwen3-MoE with LoRA on attention and experts at TP x EP: logits; with `train`, two steps with the
    tokens routed per expert and the per-expert report (engines/moe.py), frozen tensors (router included) before
    and after, the trainer's logits and the merged and adapter exports. `detach_expert`: layer 0's expert of that
    index computes its fc1 adapter detached from autograd (Megatron-Bridge #5635's failure), a negative control.
    `grads`: first-step gradients from layout-independent adapter values (compared across layouts).
    `run_dir`: after the two steps, checkpoint step 2 there (TrainerRole, as a run does) and take a third step.
    `resume`: afterwards, a fresh engine at TP1 x EP1 restores step 2 of that run directory and takes the third
    step (`_moe_third_step` reports both: the canonical state after it, its log-probs)."""
    from megatron.core.utils import unwrap_model

    from rlbridge.engines.megatron.engine import MegatronTrainEngine
    from rlbridge.engines.moe import expert_report

    recipe = make_recipe(model, lora=lora(), trainer=trainer(tp=tp, parallel={"tensor": tp, "expert": ep}))
    engine = MegatronTrainEngine(recipe)
    full, ragged = full_batch(vocab=260), ragged_batch(vocab=260)
    res: dict[str, Any] = {"batch_full": batch_dict(full), "logits_init": full_logits(engine, full)}
    sets = engine.param_sets
    res["sets_equal"] = all(
        getattr(sets, k) == sets.adapters for k in ("at_wrap", "trainable", "optimizer", "grad_buffers")
    )
    res["expert_of"] = {n: list(k) for n, k in engine.moe.expert_of.items()} if engine.moe else {}
    res["trainable"] = sorted(n for n, _ in engine._trainable)
    if (
        grads
    ):  # layout-independent adapter values (keyed by global layer and expert), then first-step gradients
        res["grads"] = _global_expert_grads(engine, ragged)
    if not train:
        engine.close()
        return res
    if detach_expert is not None:
        layer0 = unwrap_model(engine.model)[0].decoder.layers[0]
        local = (
            layer0.mlp.local_expert_indices.index(detach_expert)
            if detach_expert in layer0.mlp.local_expert_indices
            else None
        )
        if local is not None:
            adapter = layer0.mlp.experts.local_experts[local].linear_fc1.adapter
            adapter.register_forward_hook(lambda m, a, out: out.detach())
    assert engine.moe is not None
    frozen_before = engine.frozen_fingerprint()
    engine.moe.routed_tokens()  # counts start here
    with torch.no_grad():
        engine.logprobs(ragged)  # a forward without gradients: not counted
    before = engine.trainable_state()
    res["steps"] = [
        engine.train_step(ragged, mean_logprob_loss(ragged), num_micro_batches=2) for _ in range(2)
    ]
    after = engine.trainable_state()
    routed = engine.moe.routed_tokens()
    report = expert_report(engine.moe.expert_views(before), engine.moe.expert_views(after), routed)
    res["routed"] = {f"{k[0]}.{k[1]}": v for k, v in routed.items()}
    res["real_tokens"] = int(ragged.attention_mask.sum())
    res["report"] = {
        "trained": [list(k) for k in report.trained],
        "dead": [list(k) for k in report.dead],
        "unrouted": [list(k) for k in report.unrouted],
    }
    res["changed"] = {n: bool(not torch.equal(before[n], after[n])) for n in before}
    frozen_after = engine.frozen_fingerprint()
    res["frozen_moved"] = sorted(n for n, v in frozen_before.items() if frozen_after[n] != v)
    res["router_names"] = sorted(n for n in frozen_before if ".mlp.router." in n)
    res["logits_trained"] = full_logits(engine, full)
    res["merged"] = engine.export_weights("merged").tensors
    try:
        adapter = engine.export_weights("adapter")
        res["adapter"], res["adapter_config"] = adapter.tensors, adapter.adapter_config
    except Exception as e:  # reported, so the test can say what the adapter export does on experts
        res["adapter_error"] = f"{type(e).__name__}: {e}"
    if run_dir is not None:
        res["ckpt"] = _moe_third_step(recipe, model, engine, ragged, save_to=run_dir)
    engine.close()
    if resume is not None:
        recipe = make_recipe(model, lora=lora(), trainer=trainer())
        res["resumed"] = _moe_third_step(recipe, model, MegatronTrainEngine(recipe), ragged, load_from=resume)
    return res


def _moe_third_step(
    recipe: Recipe,
    model: str,
    engine: Any,
    batch: SeqBatch,
    *,
    save_to: str | None = None,
    load_from: str | None = None,
) -> dict[str, Any]:
    """Checkpoint step 2 into `save_to`, or restore it from `load_from` (then the full state right after the
    load); then one more step: its metrics, log-probs after it and the full canonical state (global rank 0)."""
    from rlbridge.run.directory import resolved_yaml
    from rlbridge.trainer.role import TrainerRole

    role = TrainerRole(recipe, model, engine_factory=lambda: engine)
    role.is_holder = torch.distributed.get_rank() == 0
    out: dict[str, Any] = {}
    if save_to is not None:
        out["saved"] = asdict(
            role.save_checkpoint(save_to, 2, {"note": "moe"}, resolved_yaml(recipe), keep=1)
        )
    if load_from is not None:
        out["state"] = role.load_checkpoint(f"{load_from}/checkpoints/step_000002")
        out["loaded"] = engine.checkpoint_state()[0]
    out["step3"] = engine.train_step(batch, mean_logprob_loss(batch), num_micro_batches=2)
    out["logprobs"] = engine.logprobs(batch)
    out["after"] = engine.checkpoint_state()[0]
    if load_from is not None:
        engine.close()
    return out


def _global_expert_grads(engine: Any, batch: SeqBatch) -> dict[str, torch.Tensor]:
    """Adapters set from generators keyed by their layout-free name (`L<layer>.E<expert>.<rest>` for experts: LoRA's
    random init depends on the layout, megatron draws expert parameters from an expert-parallel RNG), then this
    rank's first-step gradients under those names."""

    def key_of(name: str) -> str:
        if engine.moe is not None and name in engine.moe.expert_of:
            layer, e = engine.moe.expert_of[name]
            return f"L{layer}.E{e}." + name.split(".local_experts.")[1].split(".", 1)[1]
        return name

    with torch.no_grad():
        for name, p in engine._trainable:
            g = torch.Generator().manual_seed(zlib.crc32(key_of(name).encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    engine.optimizer.reload_model_params()
    grads = engine.gradients(batch, mean_logprob_loss(batch), num_micro_batches=2)
    return {key_of(n): g.clone() for n, g in grads.items()}


def moe_replay_suite(model: str, routings: list[list]) -> dict[str, Any]:
    """Routing replay (rollout.routing_replay) in the megatron engine: log-probs of the ragged batch routed by the
    model itself, then with each of `routings` ([b, S, layers, k] lists) replayed, then one training step with the
    last one replayed."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    recipe = make_recipe(model, lora=lora(), trainer=trainer(), rollout={"routing_replay": True})
    engine = MegatronTrainEngine(recipe)
    batch = ragged_batch(vocab=260)
    res: dict[str, Any] = {"plain": engine.logprobs(batch), "replayed": []}
    for routing in routings:
        batch.routed_experts = torch.tensor(routing, dtype=torch.int16)
        res["replayed"].append(engine.logprobs(batch))
    res["step"] = engine.train_step(batch, mean_logprob_loss(batch), num_micro_batches=2)
    engine.close()
    return res


def spread_batch() -> SeqBatch:
    """8 rows of very different prompt (1..14) and response (1..17) lengths (tests/fixtures/spread.py)."""
    from tests.fixtures.spread import spread_lists

    return SeqBatch.from_token_lists(*spread_lists(), pad_id=0)


BUDGET = 48
"""trainer.max_tokens_per_micro_batch for the spread batch: 5 training passes where micro_batch_size gives 3."""
LAYOUTS: tuple[tuple[str, bool, int | None, int], ...] = (
    ("padded", False, None, 1),
    ("trimmed", True, None, 1),
    ("budget", True, BUDGET, 1),
    ("rounded", True, BUDGET, 16),
)
"""(result key, padding_free, max_tokens, trainer.pass_width_multiple): the former index-order micro-batches at
the batch's width, those grouped by length and trimmed, those formed by the token budget, and those again with
every pass right-padded (masked) to 16 or 32 columns."""


def with_width_multiple(recipe: Recipe, multiple: int) -> Recipe:
    """The recipe with trainer.pass_width_multiple set (the engines read it at every split)."""
    return recipe.model_copy(
        update={"trainer": recipe.trainer.model_copy(update={"pass_width_multiple": multiple})}
    )


def padding_free_suite(qwen: str, num_micro_batches: int = 3) -> dict[str, Any]:
    """Length-grouped, trimmed micro-batches (engine.padding_free, PP = CP = 1), with and without a token budget,
    against the former index-order ones at the batch's width, under LoRA and full fine-tuning: the micro-batches'
    rows and widths, log-probs and first-step gradients of a grouping-invariant loss in each layout; under LoRA
    also PPO's critic (values, and the gradients of its value loss)."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    batch = spread_batch()
    loss = mean_logprob_loss(batch, shares=num_micro_batches)
    res: dict[str, Any] = {"batch": batch_dict(batch)}
    ppo = {"name": "ppo", "critic": {"lr": 1e-2, "value_clip": 0.2}}
    for label, section in (("lora", lora()), ("full", {"rank": 0})):
        recipe = make_recipe(qwen, lora=section, trainer=trainer(), algorithm=ppo)
        engine = MegatronTrainEngine(recipe)
        if label == "lora":
            set_adapters(engine)  # adapters that are not a no-op
            res.update(_critic_layouts(recipe, batch, num_micro_batches))
        for key, free, budget, multiple in LAYOUTS:
            engine.padding_free, engine.max_tokens = free, budget
            engine.recipe = with_width_multiple(recipe, multiple)
            key = f"{label}_{key}"
            mbs = engine._split(batch, num_micro_batches, training=True)
            res[f"{key}_rows"] = [mb.rows.tolist() for mb in mbs]
            res[f"{key}_widths"] = [int(mb.input_ids.shape[1]) for mb in mbs]
            res[f"{key}_logprobs"] = engine.logprobs(batch)
            res[f"{key}_grads"] = engine.gradients(batch, loss, num_micro_batches=num_micro_batches)
        engine.recipe = recipe
        res.update(_head_positions(engine, batch, loss, num_micro_batches, label))
        engine.close()
    return res


def _head_positions(engine: Any, batch: SeqBatch, loss: Any, num: int, label: str) -> dict[str, Any]:
    """The index-order layout with the output layer on the response positions only (the engine's default) and
    on every position (forward.response_head off): log-probs, gradients and the sequence lengths the output layer
    ran on in each."""
    from rlbridge.engines.megatron import forward

    engine.padding_free, engine.max_tokens = False, None
    layer = engine.model[0].module.output_layer
    out: dict[str, Any] = {}
    for key, on in (("response_head", True), ("every_position_head", False)):
        assert forward.response_head(engine.model, on=on) == 1
        lengths: list[int] = []

        def record(_m: Any, _a: Any, o: Any, lengths: list[int] = lengths) -> None:
            lengths.append(int(o[0].shape[0]))  # ColumnParallelLinear returns (output [s, m, v], bias)

        hook = layer.register_forward_hook(record)
        try:
            out[f"{label}_{key}_logprobs"] = engine.logprobs(batch)
            out[f"{label}_{key}_grads"] = engine.gradients(batch, loss, num_micro_batches=num)
        finally:
            hook.remove()
        out[f"{label}_{key}_lengths"] = sorted(set(lengths))
    forward.response_head(engine.model)
    return out


def _critic_layouts(recipe: Recipe, batch: SeqBatch, num_micro_batches: int) -> dict[str, Any]:
    """PPO's megatron critic (beside the policy engine) in both layouts: values, and the gradients of the value
    loss (each micro-batch's share of the batch loss: grouping-invariant)."""
    from rlbridge.algo.objective import make_value_loss_fn
    from rlbridge.engines.megatron.critic import MegatronCritic

    critic = MegatronCritic(recipe)
    g = torch.Generator().manual_seed(5)
    state = critic.trainable_state()  # adapters that are not a no-op (LoRA's B starts at 0)
    critic.load_trainable_state(
        {n: torch.randn(t.shape, generator=g) * 0.05 if "linear_out" in n else t for n, t in state.items()}
    )
    critic.set_head(
        torch.randn(1, int(critic.built.provider.hidden_size), generator=g) * 0.2, torch.tensor([0.3])
    )
    returns = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    out: dict[str, Any] = {}
    for key, free, budget, multiple in LAYOUTS:
        critic.padding_free, critic.max_tokens = free, budget
        critic.recipe = with_width_multiple(recipe, multiple)
        key = f"critic_{key}"
        mbs = critic._split(batch, num_micro_batches, training=True)
        out[f"{key}_widths"] = [int(mb.input_ids.shape[1]) for mb in mbs]
        out[f"{key}_rows"] = [mb.rows.tolist() for mb in mbs]
        out[f"{key}_values"] = values = critic.values(batch)
        fn = make_value_loss_fn(
            recipe.algorithm.critic,  # type: ignore[union-attr]  # a PpoCfg
            values.detach() + 0.1 * batch.response_mask,
            returns,
            batch.response_mask,
            micro_scale=float(num_micro_batches),
        )
        out[f"{key}_grads"] = _critic_grads(critic, batch, fn, num_micro_batches)
    return out


def _critic_grads(critic: Any, batch: SeqBatch, fn: Any, num_micro_batches: int) -> dict[str, torch.Tensor]:
    """The critic's accumulated gradients of one train_step, taken before the optimizer applies them."""
    from rlbridge.engines.megatron import params

    grads: dict[str, torch.Tensor] = {}
    state = critic.trainable_state()

    def capture() -> Any:
        for name, p in critic._trainable:
            grads[name] = params.main_grad(p).detach().clone()
        return True

    apply = critic.optimizer.step_with_ready_grads
    critic.optimizer.step_with_ready_grads = capture
    try:
        critic.train_step(batch, fn, num_micro_batches=num_micro_batches)
    finally:
        critic.optimizer.step_with_ready_grads = apply
    critic.load_trainable_state(state)
    return grads


def vocab_logprob_suite(vocab_size: int = 13, padded: int = 16) -> dict[str, Any]:
    """forward.vocab_parallel_logprobs on this rank's shard of one [2, 5, padded] float32 logits tensor (the same
    on every rank, seeded), with megatron's tensor parallelism over all ranks: log-probs and entropies of the
    targets, and the gradient of logp.sum() + 0.3 * entropy.sum() with respect to the shard; then the entropy
    as a metric only (entropy_grad False) and the gradient of logp.sum() alone. Columns past vocab_size are
    megatron's vocabulary padding."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlbridge.engines.megatron import compat, forward

    world, rank = dist.get_world_size(), dist.get_rank()
    with compat.device_scope():
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        g = torch.Generator().manual_seed(3)
        logits = torch.randn(2, 5, padded, generator=g) * 4
        targets = torch.randint(0, vocab_size, (2, 5), generator=g)
        width = padded // world
        shard = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
        logp, entropy = forward.vocab_parallel_logprobs(
            shard, targets, vocab_size=vocab_size, with_entropy=True
        )
        assert entropy is not None
        (logp.sum() + 0.3 * entropy.sum()).backward()
        assert shard.grad is not None
        # the entropy as a metric only (entropy_grad False, algorithm.entropy_coef 0): the same values, and the
        # log-probs' gradient alone
        metric = shard.detach().clone().requires_grad_(True)
        logp_m, entropy_m = forward.vocab_parallel_logprobs(
            metric, targets, vocab_size=vocab_size, with_entropy=True, entropy_grad=False
        )
        assert entropy_m is not None
        logp_m.sum().backward()
        assert metric.grad is not None
        return {
            "logits": logits,
            "targets": targets,
            "logp": logp.detach(),
            "entropy": entropy.detach(),
            "grad": shard.grad.detach(),
            "columns": (rank * width, (rank + 1) * width),
            "entropy_metric": entropy_m.detach(),
            "grad_logp_only": metric.grad.detach(),
        }
    finally:
        ps.destroy_model_parallel()


def full_ft_checkpoint(model_dir: str, run_dir: str, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """Full fine-tuning through TrainerRole at TP x PP: one Adam step, checkpoint step 1, and the trainer's logits
    at that step (what `rlbridge export-hf` of the checkpoint must reproduce)."""
    from rlbridge.engines.megatron.engine import MegatronTrainEngine
    from rlbridge.run.directory import resolved_yaml
    from rlbridge.trainer.role import TrainerRole

    recipe = make_recipe(model_dir, lora={"rank": 0}, trainer=trainer(tp=tp, pp=pp, optim=STEP_OPTIM))
    role = TrainerRole(recipe, model_dir, engine_factory=lambda: MegatronTrainEngine(recipe))
    role.is_holder = torch.distributed.get_rank() == 0
    engine: Any = role.engine
    batch = ragged_batch(seed=4, rows=4)
    res: dict[str, Any] = {"logits_init": full_logits(engine, full_batch())}
    res["step"] = engine.train_step(batch, mean_logprob_loss(batch), num_micro_batches=2)
    res["saved"] = asdict(role.save_checkpoint(run_dir, 1, {"note": "test"}, resolved_yaml(recipe), keep=1))
    res["batch_full"] = batch_dict(full_batch())
    res["logits_saved"] = full_logits(engine, full_batch())
    engine.close()
    return res


def save_faults_suite(qwen: str, run_dir: str, events: str, phase: str, disk_full: bool = False) -> None:
    """A 4-rank (TP2 x PP2) LoRA trainer saving through TrainerRole while things go wrong; global rank 0 appends
    what it saw to the JSON-lines file `events` as it goes (the launch ends with a killed rank, so nothing is
    returned). phase "first": a step, save step 1, a step; with `disk_full`, fill RUN_DIR/checkpoints (a small
    tmpfs the test mounted) to within 16 KiB and save step 2 (rank 0, the only writer, runs out of space), then
    free the space; then save step 2 again, during which the test kills rank 3 (RLBRIDGE_FAULT_PAUSE). Phase
    "second": load step 1 (still complete after all that), a step, save step 2, during which the test kills rank 0
    while it writes (tensor files written, manifest not yet)."""
    import json
    import shutil

    from rlbridge.engines.megatron.engine import MegatronTrainEngine
    from rlbridge.errors import RlbridgeError
    from rlbridge.run import checkpoint as ckpt
    from rlbridge.run.directory import resolved_yaml
    from rlbridge.trainer.role import TrainerRole

    recipe = make_recipe(qwen, lora=lora(), trainer=trainer(tp=2, pp=2, optim={"lr": 1e-2, "clip_grad": 1.0}))
    role = TrainerRole(recipe, qwen, engine_factory=lambda: MegatronTrainEngine(recipe))
    rank0 = torch.distributed.get_rank() == 0
    role.is_holder = rank0
    engine: Any = role.engine
    batch, yaml = ragged_batch(seed=4, rows=4), resolved_yaml(recipe)
    root = Path(run_dir) / ckpt.CHECKPOINTS

    def event(what: str, **data: Any) -> None:
        if rank0:
            with open(events, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": what, **data}) + "\n")

    def listing() -> list[Any]:
        return [[i.step, i.problem] for i in ckpt.list_checkpoints(Path(run_dir))]

    def step() -> None:
        engine.train_step(batch, mean_logprob_loss(batch), num_micro_batches=2)

    def save(n: int) -> None:
        try:
            saved = role.save_checkpoint(run_dir, n, {"note": f"step{n}"}, yaml, keep=3)
        except BaseException as e:
            event("save failed", step=n, error=f"{type(e).__name__}: {e}", listing=listing())
            raise
        event("saved", step=n, path=saved.path, listing=listing() if rank0 else None)

    if phase == "first":
        set_adapters(engine)
        step()
        save(1)
        step()
        if disk_full:
            filler = root / "filler"
            if rank0:
                with open(filler, "wb") as f:
                    f.write(b"\0" * (shutil.disk_usage(root).free - 16 * 2**10))
            torch.distributed.barrier()
            try:
                save(2)
            except RlbridgeError:
                pass  # recorded by save(); the other ranks returned (only rank 0 writes)
            event("after disk full", names=sorted(p.name for p in root.iterdir()))
            torch.distributed.barrier()
            if rank0:
                filler.unlink()
        save(2)  # rank 3 is killed in here
    else:
        state = role.load_checkpoint(f"{run_dir}/checkpoints/step_000001")
        event("loaded", note=state["note"])
        step()
        save(2)  # rank 0 is killed in here
