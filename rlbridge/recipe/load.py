"""Recipe loading: safe YAML, `--set` overrides, and errors a person can act on.

Every problem is collected (never only the first): YAML syntax, unknown keys (with "did you mean"),
wrong types, missing keys, and the cross-field checks of `checks/`. Each carries its dotted key, the
offending value, the YAML line where it came from, and how to fix it.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rlbridge.errors import RecipeError, RecipeIssue
from rlbridge.recipe.schema import Recipe


@dataclass(frozen=True)
class Source:
    """Where each dotted key of a recipe came from (file line or an override)."""

    file: str
    lines: dict[str, int] = field(default_factory=dict)
    overridden: frozenset[str] = frozenset()

    def where(self, key: str) -> str:
        if any(key == o or key.startswith(o + ".") for o in self.overridden):
            return "--set"
        probe = key
        while probe:
            if probe in self.lines:
                return f"{self.file}:{self.lines[probe]}"
            probe = probe.rpartition(".")[0]
        return self.file


# ------------------------------------------------------------------------------------------- YAML
def _line_map(
    node: yaml.Node, prefix: str, out: dict[str, int], issues: list[RecipeIssue], file: str
) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            dotted = f"{prefix}.{key}" if prefix else key
            if key in seen:
                issues.append(
                    RecipeIssue(
                        dotted,
                        "duplicate key (the later value would silently win)",
                        where=f"{file}:{key_node.start_mark.line + 1}",
                        fix="keep one of them",
                    )
                )
            seen.add(key)
            out[dotted] = key_node.start_mark.line + 1
            _line_map(value_node, dotted, out, issues, file)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            dotted = f"{prefix}.{i}"
            out[dotted] = item.start_mark.line + 1
            _line_map(item, dotted, out, issues, file)


def parse_yaml(text: str, file: str) -> tuple[Any, Source, list[RecipeIssue]]:
    """Parse with the safe loader only: tags such as !!python/object are errors, never executed."""
    issues: list[RecipeIssue] = []
    lines: dict[str, int] = {}
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.load(text, Loader=yaml.SafeLoader)  # noqa: S506 (SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else file
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        fix = "plain YAML only: remove the tag" if "tag" in str(problem) else "fix the YAML syntax"
        return (
            None,
            Source(file),
            [RecipeIssue("<file>", f"cannot parse YAML: {problem}", where=where, fix=fix)],
        )
    except RecursionError:
        return None, Source(file), [RecipeIssue("<file>", "YAML nested too deeply", where=file)]
    if node is not None:
        _line_map(node, "", lines, issues, file)
    return data, Source(file, lines), issues


# -------------------------------------------------------------------------------------- overrides
def parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(
            [RecipeIssue("--set", f"cannot read override {item!r}", fix="write --set a.b=value")]
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError(
            [RecipeIssue(key, f"cannot parse override value {raw!r}: {e}", where="--set")]
        ) from None
    return key, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], frozenset[str]]:
    data = copy.deepcopy(data)
    keys = []
    for item in overrides:
        key, value = parse_override(item)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
        keys.append(key)
    return data, frozenset(keys)


# -------------------------------------------------------------------------------- pydantic errors
def _model_at(loc: Sequence[Any], data: Any) -> type[BaseModel] | None:
    """The section model that owns `loc` (used to suggest keys for a typo)."""
    model: type[BaseModel] | None = Recipe
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return (
                model
                if model is not None and isinstance(part, str) and part not in model.model_fields
                else None
            )
        data = data.get(part) if isinstance(data, dict) else None
        model = _section_type(model.model_fields[part].annotation, data)
    return model


def _section_type(annotation: Any, data: Any) -> type[BaseModel] | None:
    candidates = [a for a in _flatten(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(candidates) > 1 and isinstance(data, dict):
        for c in candidates:
            name_field = c.model_fields.get("name")
            if name_field is not None and data.get("name") in get_args(name_field.annotation):
                return c
    return candidates[0] if candidates else None


def _flatten(annotation: Any) -> Iterable[Any]:
    args = get_args(annotation)
    if not args:
        yield annotation
        return
    if get_origin(annotation) in (list, dict, tuple):
        return
    for a in args:
        yield from _flatten(a)


_ALGO_TAGS = {"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"}


def _dotted(loc: Sequence[Any]) -> str:
    parts = [str(p) or repr(p) for p in loc]  # an empty key ('': in the YAML) is shown as ''
    if len(parts) > 1 and parts[0] == "algorithm" and parts[1] in _ALGO_TAGS:
        del parts[1]
    return ".".join(parts) if parts else "<recipe>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def issues_from_validation(err: ValidationError, data: Any, source: Source) -> list[RecipeIssue]:
    issues = []
    for e in err.errors():
        loc = e["loc"]
        key = _dotted(loc)
        kind = e["type"]
        if kind == "extra_forbidden":
            parent = _model_at(loc[:-1], data)
            allowed = sorted(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
            fix = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(allowed)}"
            issues.append(RecipeIssue(key, "unknown key", fix=fix, where=source.where(key)))
        elif kind == "missing":
            issues.append(
                RecipeIssue(key, "required key is missing", fix=f"add {key}", where=source.where(key))
            )
        elif kind == "union_tag_invalid":
            issues.append(
                RecipeIssue(
                    key + ".name",
                    f"unknown algorithm {_short(e['input'].get('name') if isinstance(e['input'], dict) else e['input'])}",
                    fix=f"choose one of: {', '.join(sorted(_ALGO_TAGS))}",
                    where=source.where(key),
                )
            )
        else:
            msg = e["msg"].removeprefix("Value error, ")
            issues.append(RecipeIssue(key, msg, value=_short(e.get("input")), where=source.where(key)))
    return issues


# ------------------------------------------------------------------------------------------ entry
def load_recipe_data(path: str | Path, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], Source]:
    """Read the YAML file and apply overrides; raise RecipeError on anything malformed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(
            [RecipeIssue("<file>", f"recipe file not found: {path}", fix="check the path")]
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError([RecipeIssue("<file>", f"cannot read recipe file {path}: {e}")]) from None
    data, source, issues = parse_yaml(text, str(path))
    if issues and data is None:
        raise RecipeError(issues)
    if data is None:
        raise RecipeError(
            [
                RecipeIssue(
                    "<file>",
                    "the recipe is empty",
                    where=str(path),
                    fix="start from a shipped recipe: rlbridge recipes copy quickstart recipe.yaml",
                )
            ]
        )
    if not isinstance(data, dict):
        raise RecipeError(
            [
                RecipeIssue(
                    "<file>",
                    f"the recipe must be a mapping of sections, got {type(data).__name__}",
                    where=str(path),
                )
            ]
        )
    data, overridden = apply_overrides(data, overrides)
    if issues:
        raise RecipeError(issues)
    return data, Source(source.file, source.lines, overridden)


def build_recipe(data: dict[str, Any], source: Source) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(issues_from_validation(err, data, source)) from None


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Schema validation only (no model or cluster checks): see `validate.validate_recipe` for those."""
    data, source = load_recipe_data(path, overrides)
    return build_recipe(data, source)
