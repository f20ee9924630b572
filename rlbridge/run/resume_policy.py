"""Which recipe changes a resume accepts: `check_resume_compatible` names every key that changed since the
checkpoint and may not change (RESUME_SAFE_KEYS lists those that may: they do not change what the run
computes). A key the checkpoint's recipe lacks is accepted at the schema's default: a later rlbridge added it,
and its default keeps what the earlier version computed."""

from __future__ import annotations

import json
from typing import Any

import yaml

from rlbridge.errors import RlbridgeError

RESUME_SAFE_KEYS = (
    "run.steps",
    "run.save_every",
    "run.time_limit_s",
    "run.keep",
    "run.eval_every",
    "run.eval_samples",
    "run.save_rollouts",
    "run.loggers",
    "run.wandb",
    "run.health",
    "run.dir",
    "cluster.address",
    "cluster.placement_timeout_s",
    "cluster.collective_timeout_s",
    "reward.timeout_s",
    "reward.workers",
    "reward.error_budget",
)
"""Recipe key prefixes that may change on resume: they do not change what the run computes."""
LAYOUT_KEYS = (
    "trainer.parallel.tensor",
    "trainer.parallel.pipeline",
    "trainer.parallel.virtual_pipeline",
    "trainer.parallel.expert",
    "cluster.gpus_per_node",
    "cluster.nodes",
)
"""Keys that may also change when the checkpoint is layout-free (the megatron engine's canonical tensors,
engines/megatron/state.py): the run continues at another layout, equal up to float summation order."""


class _Missing:
    def __repr__(self) -> str:
        return "<absent>"


MISSING: Any = _Missing()
"""Stands for a key present on only one side of `recipe_diff`."""


def recipe_diff(old_yaml: str, new_yaml: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs; `MISSING` where a key is absent.
    Lists are compared whole."""
    out: list[tuple[str, Any, Any]] = []
    _diff(_load_mapping(old_yaml, "old"), _load_mapping(new_yaml, "new"), "", out)
    return out


def _load_mapping(text: str, which: str) -> dict[str, Any]:
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise RlbridgeError(f"the {which} recipe is not a mapping")
    return data


def _diff(old: Any, new: Any, prefix: str, out: list[tuple[str, Any, Any]]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            _diff(
                old.get(key, MISSING), new.get(key, MISSING), f"{prefix}.{key}" if prefix else str(key), out
            )
    elif old != new or type(old) is not type(new) and not _same_number(old, new):
        out.append((prefix, old, new))


def _same_number(a: Any, b: Any) -> bool:
    return all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b)) and a == b


def is_resume_safe(key: str, *, layout_free: bool = False) -> bool:
    keys = RESUME_SAFE_KEYS + (LAYOUT_KEYS if layout_free else ())
    return any(key == p or key.startswith(p + ".") for p in keys)


def check_resume_compatible(old_yaml: str, new_yaml: str, *, layout_free: bool = False) -> list[str]:
    """One message per changed key that may not change on resume (see RESUME_SAFE_KEYS; LAYOUT_KEYS too when
    the checkpoint is `layout_free`)."""
    out = []
    for key, old, new in recipe_diff(old_yaml, new_yaml):
        if is_resume_safe(key, layout_free=layout_free):
            continue
        if old is MISSING and new is not MISSING and _same_value(new, schema_default(key)):
            continue  # a key a later rlbridge added, at its default: what the checkpoint's version computed
        why = (
            " (only a layout-free checkpoint, written by the megatron engine, loads at another parallel layout)"
            if any(key == p for p in LAYOUT_KEYS)
            else ""
        )
        out.append(
            f"{key} changed from {_show(old)} to {_show(new)} since the checkpoint; resuming would not "
            f"continue the same run{why}. Set {key} back to {_show(old)}, or start a new run"
        )
    return out


def schema_default(key: str) -> Any:
    """The recipe schema's default for dotted `key` (MISSING where it has none, or where a section's type
    depends on the recipe, as the algorithm's does)."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from rlbridge.recipe.schema import Recipe

    model: Any = Recipe
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return MISSING
        field = model.model_fields[part]
        if i == len(parts) - 1:
            if field.default_factory is not None:
                value = field.default_factory()  # type: ignore[call-arg]  # pydantic's factories take no data here
            elif field.default is PydanticUndefined:
                return MISSING
            else:
                value = field.default
            # as the saved recipe's YAML has it: sections as mappings, tuples as lists
            return json.loads(
                json.dumps(value.model_dump(mode="json") if isinstance(value, BaseModel) else value)
            )
        model = field.annotation
    return MISSING


def _same_value(a: Any, b: Any) -> bool:
    return b is not MISSING and (a == b and (type(a) is type(b) or _same_number(a, b)))


def _show(value: Any) -> str:
    return "(absent)" if value is MISSING else json.dumps(value)
