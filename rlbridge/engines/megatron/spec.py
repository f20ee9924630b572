"""The megatron trainer engine as the rest of rlbridge sees it (engines/spec.py): megatron-core models through
Megatron-Bridge (or mbridge), one process per device, every parallel layout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbridge.engines.spec import PARALLEL_DIMS, TrainerEngineSpec, TrainerMemory
from rlbridge.errors import RlbridgeError

if TYPE_CHECKING:
    from torch import Tensor

    from rlbridge.engines.base import Critic, TrainEngine
    from rlbridge.export import Exported
    from rlbridge.recipe.schema import Recipe
    from rlbridge.run.resume import ResumePoint
    from rlbridge.weights import WeightSync


def _engine(recipe: Recipe, model_dir: Path, device: str) -> TrainEngine:
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(recipe)


def _critic(recipe: Recipe, model_dir: Path, device: str) -> Critic:
    from rlbridge.engines.megatron.critic import MegatronCritic

    return MegatronCritic(recipe)


def _export(recipe: Recipe, point: ResumePoint, kind: WeightSync, log: Callable[[str], None]) -> Exported:
    """A megatron checkpoint holds full, canonical tensors (engines/megatron/state.py), whatever layout wrote
    it: under LoRA they are renamed to PEFT's names and exported by the hf exporter (no Megatron, no Ray); under
    full fine-tuning the bridge that trained them maps them to HF names (`_export_full`)."""
    from rlbridge.export import hf_exporter

    if not recipe.lora.enabled:
        return _export_full(recipe, point, log)
    if recipe.lora.type != "lora":
        raise RlbridgeError(
            f"export-hf of a megatron checkpoint of lora.type {recipe.lora.type} is not implemented yet (LoRA "
            "and full fine-tuning are: their adapters map onto PEFT's); export from the running trainer instead"
        )
    return hf_exporter(recipe, point, kind, log, to_peft=_to_peft)


def _export_full(recipe: Recipe, point: ResumePoint, log: Callable[[str], None]) -> Exported:
    """Full fine-tuning: every weight is in the checkpoint, under Megatron names; the recipe's bridge maps them to
    HF names in this process (engines/megatron/export.full_checkpoint_to_hf: one CPU rank, float32, cast to
    model.dtype)."""
    from rlbridge.engines.megatron.export import full_checkpoint_to_hf
    from rlbridge.export import Exported
    from rlbridge.model.cache import ensure_model
    from rlbridge.run import checkpoint as ckpt
    from rlbridge.weights import WeightExport, WeightSync

    base_dir = ensure_model(recipe.model.path)
    loaded = ckpt.load_checkpoint(point.path)
    if "trainable" not in loaded.tensors:
        raise RlbridgeError(f"{point.path} holds no trainable tensors (trainable.safetensors)")
    log(
        f"mapping the checkpoint's Megatron weights to HF names through {recipe.trainer.bridge} "
        f"(the model is built once on this machine, in float32, one process)"
    )
    local = recipe.model_copy(update={"model": recipe.model.model_copy(update={"path": str(base_dir)})})
    state = full_checkpoint_to_hf(local, loaded.tensors["trainable"])
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    return Exported(
        WeightExport(WeightSync.MERGED, state), config, base_dir
    )  # a tied output layer is left out


def _to_peft(recipe: Recipe, base_dir: Path, model: Any, trainable: dict[str, Tensor]) -> dict[str, Tensor]:
    """Canonical Megatron adapter names -> the hf engine's PEFT names (`model`: its peft model)."""
    from rlbridge.engines.hf.moe import megatron_experts_to_packed
    from rlbridge.engines.megatron.hf_names import lora_to_peft

    experts = {k: v for k, v in trainable.items() if ".mlp.experts." in k}
    dense = {k: v for k, v in trainable.items() if k not in experts}
    out = lora_to_peft(dense, json.loads((base_dir / "config.json").read_text(encoding="utf-8")))
    if experts:  # routed experts: into peft's packed expert LoRA (engines/hf/moe.py)
        scale = recipe.lora.alpha / recipe.lora.rank
        out.update(megatron_experts_to_packed(model, experts, scale=scale))
    return out


_GEMMA_TE_ONLY = (
    "Megatron-Bridge maps {family}'s weights ({bridge}) but builds its layers only from Transformer Engine "
    "modules ({spec}: {features}); this engine builds megatron-core's local layers without TE, which have none "
    "of them, so the model would compute other log-probs than {family} (and with Megatron-Bridge 0.3.1 and "
    "transformers 5 the bridge cannot even read the config: no rope_local_base_freq)"
)
REFUSED_MODELS = {
    "gemma3_text": _GEMMA_TE_ONLY.format(
        family="Gemma 3",
        bridge="Gemma3ModelBridge",
        spec="gemma3_layer_spec",
        features="sliding-window attention with per-layer RoPE bases, the norms after attention and MLP, "
        "zero-centred RMSNorm, q/k norms",
    ),
    "gemma2": _GEMMA_TE_ONLY.format(
        family="Gemma 2",
        bridge="Gemma2ModelBridge",
        spec="gemma2_layer_spec",
        features="attention-logit and final-logit soft-capping, sliding-window attention, the norms after "
        "attention and MLP",
    ),
}
"""Model types whose Megatron-Bridge layers need Transformer Engine (read in its gemma2/gemma3 providers; a
Gemma 3 provider built without TE holds placeholders instead of layers)."""
REFUSED_MODELS["gemma3"] = REFUSED_MODELS["gemma3_text"]  # the multimodal wrapper's language model

MEGATRON = TrainerEngineSpec(
    name="megatron",
    build=_engine,
    build_critic=_critic,
    exporter=_export,
    memory=TrainerMemory(
        mlp_bytes=10.6, logits_bytes=20.0, lora_input_copies=False, logits_response_only=False
    ),
    moe="megatron-core",
    multi_rank=True,
    parallel=frozenset(PARALLEL_DIMS),
    # the critic's value head reads the full, TP-replicated hidden states
    critic_parallel=frozenset(PARALLEL_DIMS) - {"pipeline", "context"},
    recompute_block=True,
    fused_projections=True,
    budget_flat_only=True,
    smoke=True,
    refused_models=REFUSED_MODELS,
)
