"""The recipe reference (docs/recipe-reference.md), generated from the schema's attribute docstrings.

    python -m rlbridge.recipe.docs > docs/recipe-reference.md

One source of truth: the field docs live in the schema package (rlbridge/recipe/schema/);
tests/unit/test_docs.py fails when the committed page differs from `render_reference()`.
"""

from __future__ import annotations

import enum
import re
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rlbridge.recipe.schema import Recipe

HEADER = """\
# Recipe reference

Generated from `rlbridge/recipe/schema/` by `python -m rlbridge.recipe.docs > docs/recipe-reference.md`
(or `make docs`; do not edit by hand: a test compares this page with the schema). The same text is in the JSON Schema
(`rlbridge schema`), so an editor shows it on hover ([cli.md](cli.md#editor-support)). Why the defaults are what they
are: [defaults.md](defaults.md).

Every section rejects unknown keys, with a suggestion for the closest known one. Any key can be overridden
on the command line with its dotted name: `--set trainer.parallel.tensor=2`.
"""

_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def _model(tp: Any) -> type[BaseModel] | None:
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _sub_model(tp: Any) -> tuple[type[BaseModel] | None, str]:
    """The model a field nests, and how: "" (a section), "optional" (section or null) or "list" (a list of them)."""
    if _model(tp):
        return tp, ""
    args = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) in (Union, types.UnionType) and len(args) == 1:
        inner, how = _sub_model(args[0])
        return inner, "optional" if inner and not how else how
    if get_origin(tp) is list and args and _model(args[0]):
        return args[0], "list"
    return None, ""


def _bounds(meta: list[Any]) -> list[str]:
    out = []
    for m in meta:
        for item in m.metadata if isinstance(m, FieldInfo) else [m]:
            out += [f"{_BOUNDS[k]} {getattr(item, k)}" for k in _BOUNDS if getattr(item, k, None) is not None]
    return out


def type_name(tp: Any) -> str:
    """A short readable type: `int ≥ 1`, `lora | dora`, `float > 0 | null`, `list of str`."""
    origin = get_origin(tp)
    if origin is typing.Annotated:
        base, *meta = get_args(tp)
        return " ".join([type_name(base), *_bounds(meta)])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in tp)
    if origin in (Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list of {type_name(get_args(tp)[0])}"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in get_args(tp)) + "]"
    if _model(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _default(f: FieldInfo) -> str:
    if f.is_required():
        return "**required**"
    value = f.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return f"`{value}`"


DOCS_REF = re.compile(r"\bdocs/([\w./-]+\.md(?:#[\w-]+)?)")
"""A docs page named in a field's docstring (`docs/defaults.md#pass-widths`): a link on this page, also in docs/."""


def _doc(f: FieldInfo) -> str:
    text = " ".join((f.description or "").split()).replace("|", "\\|")
    return DOCS_REF.sub(r"[\1](\1)", text)


def _type(f: FieldInfo) -> str:
    return " ".join([type_name(f.annotation), *_bounds(list(f.metadata))])


def _table(model: type[BaseModel], prefix: str, skip: Iterable[str] = ()) -> list[str]:
    rows = ["| key | type | default | |", "|---|---|---|---|"]
    seen: dict[type[BaseModel], str] = {}
    for name, f in model.model_fields.items():
        sub, how = _sub_model(f.annotation)
        if name in skip or (sub and not how):
            if sub:
                seen.setdefault(sub, name)
            continue
        if sub and how == "optional":
            same = seen.get(sub)
            doc = f"Optional; the keys of `{prefix}{same}`." if same else "Optional section (below)."
            rows.append(f"| `{prefix}{name}` | section \\| null | `null` | {(doc + ' ' + _doc(f)).strip()} |")
            continue
        if sub and how == "list":
            rows.append(
                f"| `{prefix}{name}` | list of sections \\| null | {_default(f)} | {_doc(f)} Keys of each: `{prefix}{name}[]` below. |"
            )
            continue
        rows.append(f"| `{prefix}{name}` | {_type(f)} | {_default(f)} | {_doc(f)} |")
    return rows if len(rows) > 2 else []


def _section(model: type[BaseModel], key: str, level: int, skip: Iterable[str] = ()) -> list[str]:
    out = [f"{'#' * level} `{key}`", ""]
    table = _table(model, f"{key}.", skip)
    if table:
        out += [*table, ""]
    seen: set[type[BaseModel]] = set()
    for name, f in model.model_fields.items():
        sub, how = _sub_model(f.annotation)
        if not sub or name in skip or sub in seen:
            continue
        seen.add(sub)
        out += _section(sub, f"{key}.{name}" + ("[]" if how == "list" else ""), min(level + 1, 4))
    return out


def _variant_name(v: type[BaseModel]) -> str:
    return str(get_args(v.model_fields["name"].annotation)[0])


def _algorithms() -> list[str]:
    annotation = Recipe.model_fields["algorithm"].annotation
    if get_origin(annotation) is typing.Annotated:
        annotation = get_args(annotation)[0]
    variants: list[type[BaseModel]] = list(get_args(annotation))
    base = typing.cast(type[BaseModel], variants[0].__mro__[1])  # the shared base of every algorithm
    out = [
        "## `algorithm`",
        "",
        "One of the algorithms below, chosen by `algorithm.name` (default `grpo`); each accepts only its own keys "
        "(PPO-only keys cannot appear under GRPO). Keys shared by every algorithm:",
        "",
        *_table(base, "algorithm."),
        "",
    ]
    for sub_name, f in base.model_fields.items():
        sub, _ = _sub_model(f.annotation)
        if sub:
            out += _section(sub, f"algorithm.{sub_name}", 3)
    for v in variants:
        name = _variant_name(v)
        own = [
            n
            for n, f in v.model_fields.items()
            if n != "name" and (n not in base.model_fields or f.default != base.model_fields[n].default)
        ]
        out += [f"### `algorithm.name: {name}`", ""]
        rows = ["| key | type | default | |", "|---|---|---|---|"]
        for n in own:
            fv = v.model_fields[n]
            sub, _ = _sub_model(fv.annotation)
            if sub and n in base.model_fields:
                changed = {
                    k: val
                    for k, val in fv.get_default(call_default_factory=True).model_dump().items()
                    if val != sub().model_dump()[k]
                }
                rows.append(
                    f"| `algorithm.{n}` | section | "
                    + ", ".join(f"`{k}: {val}`" for k, val in changed.items())
                    + f" | {name}'s defaults |"
                )
            elif not sub:
                rows.append(
                    f"| `algorithm.{n}` | {_type(fv)} | {_default(fv)} | {_doc(fv) or f'{name} default'} |"
                )
        out += (rows if len(rows) > 2 else ["Only the shared keys."]) + [""]
        for n in own:
            sub, _ = _sub_model(v.model_fields[n].annotation)
            if sub and n not in base.model_fields:
                out += _section(sub, f"algorithm.{n}", 4)
    return out


def render_reference() -> str:
    out = [HEADER, "## Top level", "", *_table(Recipe, "", skip=["algorithm"]), ""]
    for name, f in Recipe.model_fields.items():
        sub, _ = _sub_model(f.annotation)
        if name == "algorithm":
            out += _algorithms()
        elif sub:
            out += _section(sub, name, 2)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
