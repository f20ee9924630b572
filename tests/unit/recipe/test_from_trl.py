"""docs/migrating-from-trl.md and its one table, rlbridge.recipe.from_trl.

* The page's TRL script, converted through the table, gives the page's recipe (key by key, the recipe's
  defaults standing in for keys the page leaves out), and that recipe validates as written, with the page's
  reward module.
* A script that keeps every TRL default converts to a recipe that validates too.
* The table's TRL defaults are `GRPOConfig`'s own, and `GRPOConfig` itself computes the batch sizes the
  conversion claims. TRL is not a project dependency: with it importable (e.g. run this file with the python of
  `bench/setup_trl.sh`'s TRL_VENV) its dataclass is read; otherwise `RLBRIDGE_TRL_SOURCE` may name its
  `grpo_config.py`, whose text is parsed; without either those two tests skip, saying so.
* The loss rows of the page's "Where the losses differ" table that say "the same" are checked on float64
  tensors against TRL's aggregation written out here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlbridge.algo import losses as L
from rlbridge.errors import RecipeError
from rlbridge.recipe import validate_recipe
from rlbridge.recipe.from_trl import (
    DEFAULTS,
    ROWS,
    TrlConversionError,
    nested,
    recipe_default,
    recipe_overrides,
    render_table,
)

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "migrating-from-trl.md"
F64 = torch.float64


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), re.S)


def script_settings() -> dict[str, Any]:
    """The keyword arguments of the page's `GRPOConfig(...)` call."""
    for node in ast.walk(ast.parse(blocks("python")[0])):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "GRPOConfig":
            return {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    raise AssertionError("the page's first python block has no GRPOConfig(...) call")


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def validate(tmp_path: Path, recipe: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Validate `recipe` in a directory holding the page's data file and reward module; the issues found."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n')
    (tmp_path / "my_rewards.py").write_text(blocks("python")[1])
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    try:
        validate_recipe(tmp_path / "r.yaml")
    except RecipeError as e:
        return [f"{i.key}: {i.message}" for i in e.issues]
    return []


def test_page_table_is_generated_from_the_rows() -> None:
    text = PAGE.read_text()
    m = re.search(
        r"<!-- generated: python -m rlbridge.recipe.from_trl -->\n(.*?)<!-- end generated -->", text, re.S
    )
    assert m, "the page lost its generated table markers"
    assert m.group(1) == render_table(), (
        "docs/migrating-from-trl.md's table is out of date: paste `python -m rlbridge.recipe.from_trl` between "
        "its markers"
    )


def test_page_script_converts_to_page_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page_recipe = yaml.safe_load(blocks("yaml")[0])
    written = flat(page_recipe)
    converted = recipe_overrides(script_settings())
    for key, value in converted.items():
        expected = written.get(key, recipe_default(key))
        if isinstance(expected, tuple):
            expected = list(expected)
        assert value == expected, f"{key}: the script gives {value!r}, the page's recipe {expected!r}"
    # what the page writes beyond GRPOConfig: name, model, LoRA (peft_config), data and reward
    beyond = {k for k in written if k not in converted}
    assert all(k.split(".")[0] in {"name", "model", "lora", "data", "reward"} for k in beyond), beyond
    assert validate(tmp_path, page_recipe, monkeypatch) == []


def test_trl_defaults_convert_to_a_valid_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TrlConversionError, match="max_steps"):
        recipe_overrides({})
    recipe = nested(recipe_overrides({"max_steps": 10}))
    recipe |= {"name": "trl-defaults", "model": {"path": "smollm2-135m-instruct"}}
    recipe["data"] |= {"train": {"path": "data/train.jsonl", "prompt_key": "prompt"}}
    recipe["reward"] = {"fn": "my_rewards:correct"}
    assert validate(tmp_path, recipe, monkeypatch) == []
    assert recipe["rollout"]["engine"] == "hf" and recipe["data"]["batch_size"] == 1  # 8 completions, n = 8


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"loss_type": "sapo"}, "loss_type='sapo'"),
        ({"scale_rewards": "batch"}, "batch"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions"),
        ({"num_generations": 3}, "multiple of num_generations"),
        ({"use_liger_kernel": True}, "without a row"),
    ],
)
def test_unconvertible_settings_are_named(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(TrlConversionError, match=match):
        recipe_overrides({"max_steps": 10, **settings})


def test_conversion_details() -> None:
    out = recipe_overrides(
        {"max_steps": 5, "loss_type": "dr_grpo", "scale_rewards": False, "delta": 1.5, "top_k": 20,
         "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 4,
         "num_processes": 2, "num_generations": 4}
    )  # fmt: skip
    assert out["algorithm.loss_agg"] == "seq-mean-token-sum-norm" and out["algorithm.norm_std"] is False
    assert out["algorithm.clip.dual"] == 1.5 and out["rollout.top_k"] == 20
    # generation batch 4 x 2 x 4 = 32 completions = 8 prompts; optimizer step 4 x 2 x 2 = 16 = 4 prompts
    assert (out["data.batch_size"], out["data.mini_batch_size"], out["trainer.micro_batch_size"]) == (8, 4, 4)
    gspo = recipe_overrides({"max_steps": 5, "importance_sampling_level": "sequence"})
    assert gspo["algorithm.name"] == "gspo" and "algorithm.norm_std" not in gspo


# ------------------------------------------------------------------------------------------------
# TRL's side
# ------------------------------------------------------------------------------------------------


def trl_field_defaults() -> dict[str, Any]:
    """GRPOConfig's dataclass defaults: from TRL itself, or parsed from the source RLBRIDGE_TRL_SOURCE names."""
    if importlib.util.find_spec("trl") is not None:
        from trl import GRPOConfig

        return {
            f.name: f.default
            for f in dataclasses.fields(GRPOConfig)
            if f.default is not dataclasses.MISSING and not isinstance(f.default, dataclasses.Field)
        }
    source = os.environ.get("RLBRIDGE_TRL_SOURCE")
    if not source:
        pytest.skip(
            "trl is not installed (not a project dependency); set RLBRIDGE_TRL_SOURCE to its grpo_config.py"
        )
    from transformers import TrainingArguments

    out = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    trainer_dir = Path(source).parent
    for file, cls in ((trainer_dir / "base_config.py", "_BaseConfig"), (Path(source), "GRPOConfig")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Call):
                        for kw in item.value.keywords:
                            if kw.arg == "default" and isinstance(item.target, ast.Name):
                                out[item.target.id] = ast.literal_eval(kw.value)
    return out


def test_table_defaults_are_trls() -> None:
    real = trl_field_defaults()
    missing = [r.field for r in ROWS if r.field not in real]
    assert not missing, f"not GRPOConfig fields: {missing}"
    wrong = {r.field: (r.default, real[r.field]) for r in ROWS if real[r.field] != r.default}
    assert not wrong, f"table default != GRPOConfig default: {wrong}"


def test_trl_computes_the_same_batches() -> None:
    """GRPOConfig's __post_init__ derives the generation batch; the conversion's prompts x n must equal it."""
    pytest.importorskip("trl", reason="trl is not installed (not a project dependency)")
    from trl import GRPOConfig

    for settings in (
        script_settings(),
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 4,
         "num_generations": 4, "max_steps": 5},
        {"max_steps": 5},
    ):  # fmt: skip
        config = GRPOConfig(**{**settings, "use_cpu": True, "output_dir": "unused"})
        out = recipe_overrides(settings)
        assert out["data.batch_size"] * config.num_generations == config.generation_batch_size
        per_step = config.per_device_train_batch_size * config.world_size * config.gradient_accumulation_steps
        assert out.get("data.mini_batch_size", out["data.batch_size"]) * config.num_generations == per_step
        assert config.epsilon == out["algorithm.clip.low"]
        assert (config.epsilon_high or config.epsilon) == out["algorithm.clip.high"]


def test_defaults_table_names_every_row_once() -> None:
    assert len(DEFAULTS) == len(ROWS)


# ------------------------------------------------------------------------------------------------
# the loss rows that say "the same", against TRL's aggregation (grpo_trainer.py, _compute_loss)
# ------------------------------------------------------------------------------------------------


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (6,), generator=g)
    mask = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)
    return torch.randn(6, 8, generator=g, dtype=F64), mask


@pytest.mark.parametrize("seed", [0, 1])
def test_trl_loss_types_match_loss_agg(seed: int) -> None:
    loss, mask = batch(seed)
    max_completion_length = 12
    trl = {
        "grpo": ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(),
        "dapo": (loss * mask).sum() / mask.sum(),
        "dr_grpo": (loss * mask).sum() / (loss.size(0) * max_completion_length),
    }
    torch.testing.assert_close(L.aggregate(loss, mask, "seq-mean-token-mean"), trl["grpo"])
    torch.testing.assert_close(L.aggregate(loss, mask, "token-mean"), trl["dapo"])
    torch.testing.assert_close(
        L.aggregate(loss, mask, "seq-mean-token-sum-norm", norm_constant=max_completion_length),
        trl["dr_grpo"],
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(
    ("level", "low", "high", "delta"), [("sequence", 0.2, 0.28, None), ("token", 0.2, 0.2, 1.3)]
)
def test_trl_gspo_and_delta_match(
    agg: L.AggMode, level: L.RatioLevel, low: float, high: float, delta: float | None
) -> None:
    """TRL's sequence-level ratio and its `delta` cap against policy_loss(level="sequence") and dual_clip."""
    g = torch.Generator().manual_seed(3)
    _, mask = batch(3)
    old = -torch.rand(6, 8, generator=g, dtype=F64)
    logp0 = old + 0.3 * torch.randn(6, 8, generator=g, dtype=F64)
    adv = torch.randn(6, 1, generator=g, dtype=F64).expand(6, 8)

    def trl(lp: torch.Tensor) -> torch.Tensor:
        log_ratio = lp - old
        if level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1 - low, 1 + high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv).expand(6, 8)
        if agg == "token-mean":
            return (per_token * mask).sum() / mask.sum()
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()

    a = logp0.clone().requires_grad_(True)
    b = logp0.clone().requires_grad_(True)
    va = trl(a)
    vb = L.policy_loss(
        b, old, adv, mask, clip_low=low, clip_high=high, dual_clip=delta, agg=agg, level=level
    )[0]
    va.backward()
    vb.backward()
    torch.testing.assert_close(vb, va, rtol=1e-10, atol=1e-12)
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(b.grad, a.grad * mask, rtol=1e-10, atol=1e-12)
    if delta is not None:  # the cap is reached somewhere, or this case would prove nothing
        assert bool((torch.exp(logp0 - old)[mask > 0] > delta).any())
