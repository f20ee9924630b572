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
from rlbridge.recipe.schema import MAX_INT, NO_REWARD, Recipe


@dataclass(frozen=True)
class Source:
    """Where each dotted key of a recipe came from (file line or an override)."""

    file: str
    lines: dict[str, int] = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)
    """Dotted key -> the `--set` argument that set it."""

    @property
    def overridden(self) -> frozenset[str]:
        return frozenset(self.overrides)

    def where(self, key: str) -> str:
        """`--set ARG` for a key an override set (or one below it), else the file's line of the key or of
        the nearest section above it that the file has; a key the file lacks and an override wrote below it (an
        unknown section that `--set optim.lr=...` made) is that override's."""
        for o, argument in reversed(self.overrides.items()):  # the last override of a key is the one in force
            if key == o or key.startswith(o + "."):
                return f"--set {argument}"
        if key not in self.lines:
            for o, argument in reversed(self.overrides.items()):
                if o.startswith(key + "."):
                    return f"--set {argument}"
        probe = key
        while probe:
            if probe in self.lines:
                return f"{self.file}:{self.lines[probe]}"
            probe = probe.rpartition(".")[0]
        return self.file

    def override_in(self, *sections: str) -> str | None:
        """`--set ARG` for the last override that set one of `sections`, a key below one or a section above one;
        else None."""
        for o, argument in reversed(self.overrides.items()):
            if any(o == s or o.startswith(s + ".") or s.startswith(o + ".") for s in sections):
                return f"--set {argument}"
        return None

    def line_of(self, *keys: str) -> str | None:
        """`FILE:LINE` of the last of `keys` that the file writes; else None."""
        written = [k for k in keys if k in self.lines]
        return f"{self.file}:{self.lines[written[-1]]}" if written else None


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
    """`a.b=value` -> ("a.b", value read as a YAML scalar or flow collection). A value YAML cannot read is taken
    as the text it is: `data.template={prompt} Reply as {"answer": 1}` is a template, not a broken mapping."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(
            [
                RecipeIssue(
                    "--set",
                    f"cannot read override {item!r}",
                    where=f"--set {item}",
                    fix="write --set a.b=value",
                )
            ]
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """`data` with each `--set a.b=value` applied (a copy), and the keys set -> their arguments. A number indexes
    a list (`reward.terms.0.weight=0.5`; the index one past the end appends a new item); a key below a value
    that is not a section, or a list indexed by name or out of range, is an issue naming the argument. Every
    argument is tried; the issues of all of them are raised together."""
    data = copy.deepcopy(data)
    keys: dict[str, str] = {}
    issues: list[RecipeIssue] = []
    for item in overrides:
        try:
            key = _apply(data, item)
        except RecipeError as e:
            issues += e.issues
            continue
        keys.pop(key, None)
        keys[key] = item
    if issues:
        raise RecipeError(issues)
    return data, keys


def _apply(data: dict[str, Any], item: str) -> str:
    """Apply one `--set` argument to `data` in place (see apply_overrides); returns its key."""
    key, value = parse_override(item)
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(parts[:i])
        if isinstance(node, list):
            index = _list_index(node, part, here, key, item)
            if index == len(node):
                node.append({})
            if last:
                node[index] = value
            else:
                if node[index] is None:
                    node[index] = {}
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
        else:
            raise RecipeError(
                [
                    RecipeIssue(
                        key,
                        f"{here} is a value ({_short(node)}), not a section: it has no key {part!r}",
                        where=f"--set {item}",
                        fix=f"write --set {here}=VALUE",
                    )
                ]
            )
    return key


def _list_index(node: list[Any], part: str, here: str, key: str, item: str) -> int:
    """The list position `part` names in an override (see apply_overrides), or a RecipeError."""
    if not part.isdigit():
        example = ".".join([here, "0", *key.split(".")[len(here.split(".")) :]])
        raise RecipeError(
            [
                RecipeIssue(
                    key,
                    f"{here} is a list of {len(node)} item(s): index it by number",
                    where=f"--set {item}",
                    fix=f"write --set {example}={item.partition('=')[2]}",
                )
            ]
        )
    index = int(part)
    if index > len(node):
        raise RecipeError(
            [
                RecipeIssue(
                    f"{here}.{index}",
                    f"{here} has {len(node)} item(s) (0 to {len(node) - 1}): index {index} is past its end",
                    where=f"--set {item}",
                    fix=f"index an item from {here}.0 to {here}.{len(node) - 1}, or {here}.{len(node)} to add one",
                )
            ]
        )
    return index


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
            fix = NO_REWARD if key == "reward" else f"add {key}"
            issues.append(RecipeIssue(key, "required key is missing", fix=fix, where=source.where(key)))
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
            value_fix = _value_fix(kind, key, e.get("ctx") or {}, e.get("input"), _default_at(loc, data))
            issues.append(
                RecipeIssue(key, msg, value=_short(e.get("input")), where=source.where(key), fix=value_fix)
            )
    return issues


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _value_fix(kind: str, key: str, ctx: dict[str, Any], value: Any, default: Any) -> str | None:
    """The fix of a value the schema refused (pydantic's error type `kind`), with the key's default."""
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), None)
        fix = f"set {key} {_BOUNDS[kind]} {bound}"
    elif kind == "finite_number":
        fix = f"write a finite number for {key} (.inf and .nan are not values a run can use)"
    elif kind in ("int_too_large", "int_parsing_size"):
        fix = f"set {key} <= {MAX_INT}"
    elif kind in ("int_parsing", "int_type", "int_from_float"):
        text = " (YAML reads 1e23 as text: write the digits)" if isinstance(value, str) else ""
        fix = f"write {key} as a whole number{text}, at most {MAX_INT}"
    elif kind in ("float_parsing", "float_type"):
        fix = f"write {key} as a number"
    elif kind in ("bool_parsing", "bool_type"):
        fix = f"write {key}: true or {key}: false"
    elif kind in ("literal_error", "enum"):
        fix = f"choose one of: {ctx.get('expected')}"
    else:
        return None
    if default is not None and isinstance(default, int | float | str) and not isinstance(default, bool):
        fix += f" (default: {default})"
    return fix


def _default_at(loc: Sequence[Any], data: Any) -> Any:
    """The schema's default of the key at `loc`, or None (no default, or a key the schema does not have)."""
    parent = _model_at(loc[:-1], data) if loc else None
    name = loc[-1] if loc else None
    if parent is None or not isinstance(name, str) or name not in parent.model_fields:
        return None
    info = parent.model_fields[name]
    return None if info.is_required() else info.default


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
