"""TRL's `GRPOConfig`, field by field, as recipe keys: the one table behind docs/migrating-from-trl.md.

Each row names a `GRPOConfig` field (TRL 1.16, with the `TrainingArguments` fields a GRPO script sets), its
default there, the recipe keys it becomes and how its value is carried over. `recipe_overrides` applies every
row to a script's settings and returns dotted recipe keys (what `--set` takes); `render_table` prints the
table the page shows, so the page, the conversion and the test that checks TRL's real defaults
(tests/unit/recipe/test_from_trl.py) read the same rows. Nothing here imports TRL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from rlbridge.recipe.schema import GrpoCfg, Recipe

Settings = Mapping[str, Any]
"""A script's `GRPOConfig` settings by field name; a field left out has TRL's default."""


class TrlConversionError(ValueError):
    """A `GRPOConfig` setting that has no recipe counterpart; the message says which field and why."""


@dataclass(frozen=True)
class Row:
    field: str
    """The `GRPOConfig` field."""
    default: Any
    """Its default in TRL 1.16 (the dataclass default, before `__post_init__`)."""
    keys: tuple[str, ...]
    """Recipe keys it sets; empty: no counterpart."""
    note: str
    convert: Callable[[Settings], dict[str, Any]] | None = None
    """The recipe keys for a script's settings; None: carried by another row, or no counterpart."""


def _get(s: Settings, name: str) -> Any:
    return s[name] if name in s else DEFAULTS[name]


def _same(name: str, key: str) -> Callable[[Settings], dict[str, Any]]:
    return lambda s: {key: _get(s, name)}


def _batches(s: Settings) -> dict[str, Any]:
    """TRL counts completions per device; the recipe counts prompts per step (each sampled rollout.n times)."""
    n, per_device = _get(s, "num_generations"), _get(s, "per_device_train_batch_size")
    procs, accum = int(s.get("num_processes", 1)), _get(s, "gradient_accumulation_steps")
    steps_per_gen = _get(s, "steps_per_generation")
    gen_batch = _get(s, "generation_batch_size")
    if gen_batch is None:
        gen_batch = per_device * procs * (accum if steps_per_gen is None else steps_per_gen)
    opt_batch = per_device * procs * accum
    for what, size in (("generation batch", gen_batch), ("optimizer step", opt_batch)):
        if size % n:
            raise TrlConversionError(
                f"the {what} holds {size} completions, not a whole number of groups of num_generations={n}: "
                "the recipe counts prompts (data.batch_size, data.mini_batch_size); make it a multiple of "
                "num_generations"
            )
    out: dict[str, Any] = {"data.batch_size": gen_batch // n, "trainer.micro_batch_size": per_device}
    if opt_batch != gen_batch:
        out["data.mini_batch_size"] = opt_batch // n
    return out


LOSS_AGG = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
"""TRL's loss_type -> algorithm.loss_agg (the others, cispo, sapo, luspo and vespo, have no counterpart)."""


def _algorithm(s: Settings) -> dict[str, Any]:
    level, loss_type, scale = (
        _get(s, "importance_sampling_level"),
        _get(s, "loss_type"),
        _get(s, "scale_rewards"),
    )
    if loss_type not in LOSS_AGG:
        raise TrlConversionError(
            f"loss_type={loss_type!r} has no counterpart: algorithm.loss_agg takes {sorted(LOSS_AGG)}'s "
            f"aggregations ({', '.join(sorted(set(LOSS_AGG.values())))})"
        )
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale == "batch":
        raise TrlConversionError(
            "scale_rewards='batch' has no counterpart: the group's standard deviation (group) or none"
        )
    out: dict[str, Any] = {"algorithm.name": "gspo" if level == "sequence" else "grpo"}
    if level == "sequence" and scale != "group":
        raise TrlConversionError("importance_sampling_level='sequence' (gspo) always scales by the group std")
    if level != "sequence":
        out["algorithm.norm_std"] = scale == "group"
    out["algorithm.loss_agg"] = LOSS_AGG[loss_type]
    return out


def _clip(s: Settings) -> dict[str, Any]:
    eps = _get(s, "epsilon")
    high = _get(s, "epsilon_high")
    out = {"algorithm.clip.low": eps, "algorithm.clip.high": eps if high is None else high}
    if _get(s, "delta") is not None:
        out["algorithm.clip.dual"] = _get(s, "delta")
    return out


def _schedule(s: Settings) -> dict[str, Any]:
    name = str(_get(s, "lr_scheduler_type"))
    if name not in ("linear", "cosine", "constant", "constant_with_warmup"):
        raise TrlConversionError(
            f"lr_scheduler_type={name!r}: trainer.optim.schedule takes linear, cosine, constant"
        )
    return {"trainer.optim.schedule": "constant" if name.startswith("constant") else name}


def _steps(s: Settings) -> dict[str, Any]:
    steps = _get(s, "max_steps")
    if steps is None or steps <= 0:
        raise TrlConversionError(
            "max_steps is not set (TRL then trains num_train_epochs epochs): run.steps needs the number, "
            "epochs x prompts / data.batch_size"
        )
    return {"run.steps": steps}


def _loggers(s: Settings) -> dict[str, Any]:
    report = _get(s, "report_to")
    names = [report] if isinstance(report, str) else list(report or [])
    return {"run.loggers": ["console", "jsonl"] + [x for x in names if x in ("wandb", "tensorboard")]}


def _rollout_engine(s: Settings) -> dict[str, Any]:
    if not _get(s, "use_vllm"):
        return {"rollout.engine": "hf"}
    if _get(s, "vllm_mode") != "colocate":
        return {"rollout.engine": "vllm", "cluster.colocate": False}
    return {"rollout.engine": "vllm", "cluster.colocate": True}


def _top_k(s: Settings) -> dict[str, Any]:
    k = _get(s, "top_k")
    return {"rollout.top_k": -1 if k in (0, None) else k}


def _dtype(s: Settings) -> dict[str, Any]:
    bf16 = _get(s, "bf16")
    return {"model.dtype": "bfloat16" if bf16 in (None, True) else "float32"}


def _recompute(s: Settings) -> dict[str, Any]:
    if not _get(s, "gradient_checkpointing"):
        return {"trainer.recompute.granularity": "none"}
    # transformers checkpoints every decoder layer: full recompute, in groups of one layer
    return {"trainer.recompute.granularity": "full", "trainer.recompute.method": "uniform",
            "trainer.recompute.num_layers": 1}  # fmt: skip


def _save_every(s: Settings) -> dict[str, Any]:
    every, steps = _get(s, "save_steps"), _get(s, "max_steps")
    return {"run.save_every": 0 if steps is not None and 0 < steps <= every else every}


def _unsupported(name: str, why: str) -> Callable[[Settings], dict[str, Any]]:
    def convert(s: Settings) -> dict[str, Any]:
        if _get(s, name) != DEFAULTS[name]:
            raise TrlConversionError(f"{name}={_get(s, name)!r} has no counterpart: {why}")
        return {}

    return convert


ROWS: tuple[Row, ...] = (
    Row("num_generations", 8, ("rollout.n",), "the group size", _same("num_generations", "rollout.n")),
    Row("per_device_train_batch_size", 8, ("data.batch_size", "data.mini_batch_size", "trainer.micro_batch_size"),
        "TRL counts completions per device, the recipe prompts per step: data.batch_size = generation batch / "
        "num_generations, data.mini_batch_size = completions per optimizer step / num_generations, "
        "trainer.micro_batch_size = per_device_train_batch_size", _batches),
    Row("gradient_accumulation_steps", 1, ("data.mini_batch_size",), "see per_device_train_batch_size"),
    Row("steps_per_generation", None, ("data.batch_size",),
        "optimizer steps per generation batch (default: gradient_accumulation_steps): data.batch_size / "
        "data.mini_batch_size"),
    Row("generation_batch_size", None, ("data.batch_size",), "completions per generation: data.batch_size x rollout.n"),
    Row("num_iterations", 1, ("trainer.ppo_epochs",), "passes over each generation batch",
        _same("num_iterations", "trainer.ppo_epochs")),
    Row("learning_rate", 1e-6, ("trainer.optim.lr",), "", _same("learning_rate", "trainer.optim.lr")),
    Row("lr_scheduler_type", "linear", ("trainer.optim.schedule",),
        "TRL's default decays linearly to 0; the recipe's default is constant", _schedule),
    Row("warmup_steps", 0, ("trainer.optim.warmup_steps",), "", _same("warmup_steps", "trainer.optim.warmup_steps")),
    Row("weight_decay", 0.0, ("trainer.optim.weight_decay",), "",
        _same("weight_decay", "trainer.optim.weight_decay")),
    Row("adam_beta1", 0.9, ("trainer.optim.betas",), "with adam_beta2",
        lambda s: {"trainer.optim.betas": [_get(s, "adam_beta1"), _get(s, "adam_beta2")]}),
    Row("adam_beta2", 0.999, ("trainer.optim.betas",), "see adam_beta1"),
    Row("adam_epsilon", 1e-8, ("trainer.optim.eps",), "", _same("adam_epsilon", "trainer.optim.eps")),
    Row("max_grad_norm", 1.0, ("trainer.optim.clip_grad",), "", _same("max_grad_norm", "trainer.optim.clip_grad")),
    Row("max_steps", -1, ("run.steps",), "required: TRL's default trains num_train_epochs (3) epochs", _steps),
    Row("seed", 42, ("run.seed",), "", _same("seed", "run.seed")),
    Row("output_dir", None, ("run.dir",), "TRL: trainer_output when None; the recipe: runs/NAME",
        lambda s: {} if _get(s, "output_dir") is None else {"run.dir": _get(s, "output_dir")}),
    Row("gradient_checkpointing", True, ("trainer.recompute.granularity",),
        "TRL turns it on by default; true: granularity full, method uniform, num_layers 1",
        _recompute),
    Row("bf16", None, ("model.dtype",),
        "TRL: bf16 mixed precision (None becomes True unless fp16); the recipe trains in model.dtype", _dtype),
    Row("beta", 0.0, ("algorithm.kl.coef",),
        "KL in the loss (algorithm.kl.where: loss) with k3 = algorithm.kl.estimator: low_var_kl, which is "
        "clamped here and not in TRL; TRL also multiplies it by the importance ratio (use_bias_correction_kl)",
        _same("beta", "algorithm.kl.coef")),
    Row("epsilon", 0.2, ("algorithm.clip.low", "algorithm.clip.high"), "", _clip),
    Row("epsilon_high", None, ("algorithm.clip.high",), "None: epsilon"),
    Row("delta", None, ("algorithm.clip.dual",),
        "TRL's two-sided clip caps the ratio at delta: the same loss as the dual clip c = delta"),
    Row("loss_type", "dapo", ("algorithm.loss_agg",),
        "dapo and bnpo: token-mean; grpo: seq-mean-token-mean; dr_grpo: seq-mean-token-sum-norm (norm "
        "rollout.max_response_tokens, TRL's max_completion_length); cispo, sapo, luspo, vespo: none", _algorithm),
    Row("scale_rewards", "group", ("algorithm.norm_std",), "group: true; none: false; batch: no counterpart"),
    Row("importance_sampling_level", "token", ("algorithm.name",), "token: grpo; sequence: gspo"),
    Row("entropy_coef", 0.0, ("algorithm.entropy_coef",),
        "TRL adds a token-mean entropy whatever the loss_type; the recipe aggregates it as algorithm.loss_agg",
        _same("entropy_coef", "algorithm.entropy_coef")),
    Row("temperature", 1.0, ("rollout.temperature",), "", _same("temperature", "rollout.temperature")),
    Row("top_p", 1.0, ("rollout.top_p",), "", _same("top_p", "rollout.top_p")),
    Row("top_k", 0, ("rollout.top_k",), "off: 0 in TRL, -1 in the recipe", _top_k),
    Row("max_completion_length", 512, ("rollout.max_response_tokens",), "",
        _same("max_completion_length", "rollout.max_response_tokens")),
    Row("use_vllm", False, ("rollout.engine",), "False: transformers' generate (rollout.engine: hf)",
        _rollout_engine),
    Row("vllm_mode", "colocate", ("cluster.colocate",), "colocate: true; server: false"),
    Row("vllm_gpu_memory_utilization", 0.3, ("rollout.gpu_memory_utilization",), "",
        _same("vllm_gpu_memory_utilization", "rollout.gpu_memory_utilization")),
    Row("vllm_tensor_parallel_size", 1, ("rollout.tensor_parallel",), "",
        _same("vllm_tensor_parallel_size", "rollout.tensor_parallel")),
    Row("vllm_importance_sampling_correction", True, (),
        "with use_vllm, TRL masks sequences whose rollout-to-trainer ratio (the product over tokens) is outside "
        "[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]; the recipe's "
        "algorithm.rollout_correction is off by default and its sequence ratio is the geometric mean "
        "(docs/rollout-correction.md)"),
    Row("mask_truncated_completions", False, (), "no counterpart: truncated completions stay in the loss",
        _unsupported("mask_truncated_completions", "truncated completions stay in the loss")),
    Row("top_entropy_quantile", 1.0, (), "no counterpart: every token is in the loss",
        _unsupported("top_entropy_quantile", "every token is in the loss")),
    Row("reward_weights", None, ("reward.terms",), "one weight per reward function: reward.terms[i].weight"),
    Row("shuffle_dataset", True, ("data.shuffle",), "", _same("shuffle_dataset", "data.shuffle")),
    Row("save_steps", 500, ("run.save_every",), "0 (at the end and on SIGTERM) when not below max_steps", _save_every),
    Row("save_total_limit", None, ("run.keep",), "None keeps every checkpoint; run.keep is a number",
        lambda s: {} if _get(s, "save_total_limit") is None else {"run.keep": _get(s, "save_total_limit")}),
    Row("run_name", None, ("run.wandb.name",), "None: the run directory's name",
        lambda s: {} if _get(s, "run_name") is None else {"run.wandb.name": _get(s, "run_name")}),
    Row("report_to", "none", ("run.loggers",), "wandb and tensorboard are carried over; console and jsonl "
        "are always on", _loggers),
)  # fmt: skip

DEFAULTS: dict[str, Any] = {r.field: r.default for r in ROWS}


def recipe_overrides(settings: Settings) -> dict[str, Any]:
    """The dotted recipe keys a script's `GRPOConfig` settings become (unset fields: TRL's defaults).

    `num_processes` (not a GRPOConfig field) is the script's number of training processes (default 1).
    Raises TrlConversionError for a field this table does not know or a value with no counterpart."""
    unknown = sorted(set(settings) - set(DEFAULTS) - {"num_processes"})
    if unknown:
        raise TrlConversionError(f"GRPOConfig fields without a row in rlbridge.recipe.from_trl: {unknown}")
    out: dict[str, Any] = {}
    for row in ROWS:
        if row.convert is not None:
            out.update(row.convert(settings))
    return out


def nested(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys as the nested mapping a recipe file holds."""
    out: dict[str, Any] = {}
    for dotted, value in overrides.items():
        node = out
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def recipe_default(key: str) -> Any:
    """A recipe key's default (algorithm keys: GRPO's); '(required)' where the recipe must set it."""
    model: type[BaseModel] = Recipe
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part not in model.model_fields:
            raise KeyError(key)
        info = model.model_fields[part]
        value = (
            GrpoCfg()
            if key.startswith("algorithm.") and i == 0
            else info.get_default(call_default_factory=True)
        )
        if i == len(parts) - 1:
            return "(required)" if info.is_required() else value
        if isinstance(value, BaseModel):
            model = type(value)
        elif isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            model = info.annotation  # a required section (model, data): its own fields have defaults
        else:
            raise KeyError(key)
    raise KeyError(key)


def _cell(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "-"
    if value == "(required)":
        return str(value)
    return f"`{list(value) if isinstance(value, tuple) else value!r}`"


def render_table() -> str:
    """The page's table: GRPOConfig field, TRL default, recipe keys, the recipe's default, note."""
    lines = [
        "| `GRPOConfig` | TRL default | recipe | recipe default | notes |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        keys = ", ".join(f"`{k}`" for k in row.keys) or "-"
        defaults = ", ".join(_cell(recipe_default(k)) for k in row.keys if k != "reward.terms") or "-"
        lines.append(f"| `{row.field}` | {_cell(row.default)} | {keys} | {defaults} | {row.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_table(), end="")
