"""`rlbridge train --smoke RECIPE`: run a recipe's wiring on CPU, on a shrunk random copy of its model.

A 7B recipe's layout bugs (LoRA after the wrap, sizes that never reach the provider, zero gradients under
recompute, an export that loses a tensor) do not need 7B weights to show; they need the same architecture
and the same parallel layout. The smoke run keeps:

* the architecture: model type, attention layout (grouped-query ratio, up to 4 query heads per KV head),
  biases, tied or untied embeddings, MoE routing (fewer, smaller experts);
* the parallel layout: tensor, pipeline, virtual pipeline, expert sizes and the world size (one CPU worker
  process per device, gloo), recompute, LoRA, the algorithm, data, reward and batch arithmetic rules;

and shrinks the rest so two steps take about a minute: layers (pipeline x virtual stages x the layers
recompute needs per stage), head_dim 32, hidden = heads x 32, a byte-level vocabulary (260 ids), short
responses, the smallest batch the batch rules allow. Settings that cannot run on CPU are turned off:
sequence parallel and the distributed optimizer (gloo has no reduce-scatter), context parallel (needs
Transformer Engine's attention). Rollouts use the hf engine (vLLM's CPU build would load as well but
starts slowly; the weight sync goes through the same export). Every change is returned as a `--set`
override with a note, and printed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbridge.engines.registry import trainer_engine, trainer_engines_that
from rlbridge.errors import RlbridgeError
from rlbridge.model.info import SHORT_NAMES, cache_dir, config_file
from rlbridge.recipe.schema import Recipe
from rlbridge.rollout.registry import ROLLOUT_ENGINES, rollout_engine

HEAD_DIM = 32
"""The smallest head size vLLM's CPU attention accepts (the shrunk model stays servable there)."""
STEPS = 2
RESPONSE_TOKENS = 16
LENGTH_WEIGHT = 0.001
CPU_ONLY_KEYS = (
    "trainer.parallel.sequence_parallel",
    "trainer.distributed_optimizer",
    "trainer.parallel.context",
)
"""Recipe keys whose CPU-only validation issues the smoke run fixes itself (by turning them off)."""
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass
class SmokePlan:
    config: dict[str, Any]
    """The shrunk config.json."""
    overrides: list[str] = field(default_factory=list)
    """`--set` overrides that turn the recipe into its smoke run (model.path comes last, once built)."""
    notes: list[str] = field(default_factory=list)


def read_config(recipe: Recipe) -> dict[str, Any]:
    if recipe.model.path in SHORT_NAMES:
        return dict(SHORT_NAMES[recipe.model.path])
    path = config_file(recipe.model.path, recipe.model.revision, download=True)
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        raise RlbridgeError(
            f"--smoke needs the model's config.json ({path}): {e}; point model.path at a "
            "directory that holds it (the weights are not needed)"
        ) from None


def shrink_config(config: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """The same architecture at toy size, still divisible by the recipe's parallel layout."""
    p, rc = recipe.trainer.parallel, recipe.trainer.recompute
    text = config.get("text_config")
    if isinstance(text, dict):
        raise RlbridgeError("--smoke does not shrink multimodal models (config.json has text_config) yet")
    stages = p.pipeline * (p.virtual_pipeline or 1)
    per_stage = max(rc.num_layers or 1, 1) if rc.granularity == "full" else 1
    if stages * per_stage < 2:
        per_stage = 2
    heads, kv = (
        int(config["num_attention_heads"]),
        int(config.get("num_key_value_heads") or config["num_attention_heads"]),
    )
    new_kv = p.tensor if kv < heads else max(p.tensor, 2)
    group = min(heads // kv, 4) if kv < heads else 1
    new_heads = new_kv * group
    hidden = new_heads * HEAD_DIM
    out = {
        k: v
        for k, v in config.items()
        if k not in ("layer_types", "torch_dtype", "dtype", "quantization_config")
    }
    out.update(
        num_hidden_layers=stages * per_stage,
        num_attention_heads=new_heads,
        num_key_value_heads=new_kv,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
    )
    if "head_dim" in config:
        out["head_dim"] = HEAD_DIM
    for key in _EXPERT_KEYS:
        if config.get(key):
            out[key] = max(2 * p.expert, 4)
            out["num_experts_per_tok"] = min(int(config.get("num_experts_per_tok") or 2), 2)
            out["moe_intermediate_size"] = hidden
            if config.get("shared_expert_intermediate_size"):
                out["shared_expert_intermediate_size"] = hidden
    if isinstance(config.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < out["num_hidden_layers"]]
    return out


def _small_batch(recipe: Recipe, dp: int) -> tuple[int, int]:
    """(batch_size, mini_batch_size): the fewest prompts per mini-batch that split over `dp` ranks into
    whole micro-batches, and up to two mini-batches per step if the recipe has several."""
    n, mbs = recipe.rollout.n, recipe.trainer.micro_batch_size
    mini = next(b for b in range(1, 1025) if (b * n) % dp == 0 and ((b * n) // dp) % mbs == 0)
    minis = min(recipe.data.batch_size // recipe.mini_batch_size, 2)
    return mini * minis, mini


def plan_smoke(recipe: Recipe, config: dict[str, Any]) -> SmokePlan:
    if not trainer_engine(recipe).smoke:
        names = trainer_engines_that(lambda e: e.smoke)
        raise RlbridgeError(
            f"--smoke checks {names} recipes (trainer.engine: {names}); "
            f"an {recipe.trainer.engine} recipe runs on CPU as is"
        )
    r, p = recipe, recipe.trainer.parallel
    plan = SmokePlan(shrink_config(config, recipe))
    c = plan.config
    world = r.world_size

    def setting(key: str, value: Any, note: str | None = None) -> None:
        plan.overrides.append(f"{key}={json.dumps(value)}")
        if note:
            plan.notes.append(note)

    plan.notes.append(
        f"model: {config.get('architectures', ['?'])[0]} shrunk to {c['num_hidden_layers']} layers, hidden "
        f"{c['hidden_size']}, {c['num_attention_heads']} heads / {c['num_key_value_heads']} KV heads of "
        f"{HEAD_DIM}, byte vocabulary, random float32 weights"
    )
    setting("model.dtype", "float32")
    setting(
        "cluster.device",
        "cpu",
        f"cluster: {world} CPU worker processes (gloo) in place of {world} GPUs"
        + (f" on {r.cluster.nodes} nodes" if r.cluster.nodes > 1 else ""),
    )
    setting("cluster.nodes", 1)
    setting("cluster.gpus_per_node", world)
    setting("cluster.address", None)
    setting("cluster.collective_timeout_s", 600)
    cp = p.context
    if p.sequence_parallel:
        setting(
            "trainer.parallel.sequence_parallel",
            False,
            "trainer.parallel.sequence_parallel turned off: it needs reduce-scatter, which gloo (CPU) lacks",
        )
    if r.trainer.distributed_optimizer:
        setting(
            "trainer.distributed_optimizer",
            False,
            "trainer.distributed_optimizer turned off: it needs reduce-scatter, which gloo (CPU) lacks",
        )
    if p.context > 1:
        cp = 1
        setting(
            "trainer.parallel.context",
            1,
            f"trainer.parallel.context {p.context} -> 1: context parallel needs Transformer Engine's attention; "
            "its ranks become data-parallel ranks",
        )
    if r.trainer.grad_reduce_dtype != "float32":
        setting("trainer.grad_reduce_dtype", "float32")
    stand_in = next(e for e in ROLLOUT_ENGINES.values() if e.stand_in)
    setting(
        "rollout.engine",
        stand_in.name,
        f"rollout: {stand_in.name} engine in place of {r.rollout.engine} (same weight-sync export)"
        if rollout_engine(r) is not stand_in
        else None,
    )
    setting("rollout.tensor_parallel", 1)
    setting("rollout.max_response_tokens", RESPONSE_TOKENS)
    max_prompt = min(
        r.rollout.max_prompt_tokens, int(c.get("max_position_embeddings") or 2048) - RESPONSE_TOKENS
    )
    setting("rollout.max_prompt_tokens", max_prompt)
    dp = max(world // (p.tensor * p.pipeline * cp), 1)
    batch, mini = _small_batch(r, dp)
    setting("data.batch_size", batch)
    setting("data.mini_batch_size", mini)
    plan.notes.append(
        f"batch: {batch} prompts x n {r.rollout.n} per step ({batch // mini} mini-batch(es)), responses of "
        f"at most {RESPONSE_TOKENS} tokens, {STEPS} steps"
    )
    setting("run.steps", STEPS)
    setting("run.eval_every", 0)
    setting("run.eval_samples", 2)
    setting("run.save_every", 0)
    setting("run.dir", None)
    terms = [t.model_dump() for t in r.reward.resolved_terms()] + [{"fn": "length", "weight": LENGTH_WEIGHT}]
    setting("reward.fn", None)
    setting(
        "reward.terms",
        terms,
        f"reward: + {LENGTH_WEIGHT} x length, so the random model has a learning signal and the gradient "
        "path (grad_norm > 0, every trainable tensor changes) is checked",
    )
    return plan


def build_smoke_model(config: dict[str, Any], *, seed: int, progress: Any = print) -> Path:
    """The shrunk model's directory in rlbridge's cache (built once per config)."""
    from rlbridge.model.cache import MARKER
    from rlbridge.model.random_weights import build_random_model

    key = hashlib.sha256(json.dumps({"config": config, "seed": seed}, sort_keys=True).encode()).hexdigest()[
        :16
    ]
    target = cache_dir() / "smoke" / f"{config.get('model_type', 'model')}-{key}"
    if (target / MARKER).is_file():
        return target
    progress(f"building the shrunk random model into {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smoke-", dir=target.parent))
    try:
        build_random_model(config, tmp, seed=seed)
        (tmp / MARKER).write_text('{"source": "smoke"}\n', encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
