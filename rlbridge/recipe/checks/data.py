"""The datasets a recipe points at, checked on their first rows: that the source opens, that the prompt and answer
columns are there, that data.template's fields are columns of the rows, and that conversations (prompts given as
messages) meet a chat template. Each issue names the split, the row and the recipe key to change; one about rows
(a key elsewhere, such as data.columns.prompt) has the keys that chose the split's rows for its origin (path,
config, split), so that a `--set` that pointed the split at those rows (`--set data.train.split=test`) is the one
blamed, or, without one, the recipe line that did.

Only the first PREVIEW_ROWS rows are read (a local file is streamed, never converted), so validation stays fast
on a file of millions of rows; rows further down are checked when they are sampled.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any, Literal

from rlbridge.errors import DataError, RecipeIssue, RlbridgeError
from rlbridge.recipe.checks.common import Issues
from rlbridge.recipe.schema import DataCfg, DatasetCfg, Recipe

PREVIEW_ROWS = 100
"""Rows of each split read by validate-recipe."""


def check_data(r: Recipe, out: Issues) -> None:
    template_fields = _template_fields(r.data, out)
    _check_chat_template(r.data, out)
    splits: tuple[tuple[Literal["train", "val"], DatasetCfg | None], ...] = (
        ("train", r.data.train),
        ("val", r.data.val),
    )
    for which, ds in splits:
        if ds is None:
            continue
        if ds.path.startswith("builtin:"):
            if ds.path != "builtin:arithmetic":
                out.append(
                    RecipeIssue(
                        f"data.{which}.path",
                        f"unknown builtin dataset {ds.path!r}",
                        fix="use builtin:arithmetic, a data file (.jsonl, .parquet, .json, .csv), a folder or a "
                        "Hugging Face Hub dataset name",
                    )
                )
                continue
            from rlbridge.data.datasets.load import check_builtin

            try:
                check_builtin(ds, f"data.{which}")
            except DataError as e:
                out.append(_data_issue(e, f"data.{which}"))
                continue
            if template_fields:
                from rlbridge.data.arithmetic import arithmetic_rows

                row = arithmetic_rows(r.data.arithmetic, split=which, seed=0)[0]
                _check_template_fields(template_fields, f"data.{which}", "row 1", row, r.data, out)
            continue
        _check_rows(r, ds, which, template_fields, out)


def chose(key: str, but: str = "") -> tuple[str, ...]:
    """The keys of split `key` (data.train) that choose its rows, least specific first, without `but`."""
    return tuple(k for k in (f"{key}.path", f"{key}.config", f"{key}.split") if k != but)


def _data_issue(e: DataError, key: str) -> RecipeIssue:
    """A split or config the source of split `key` lacks, as a recipe issue: the other keys that chose the source
    are its origin (an issue on the path itself has none)."""
    origin = () if e.key == f"{key}.path" else chose(key, but=e.key)
    return RecipeIssue(e.key, e.message, value=e.value, fix=e.fix, origin=origin)


def _template_fields(data: DataCfg, out: Issues) -> set[str] | None:
    """The row fields data.template names (None when str.format cannot fill it by name: an issue whose fix is the
    template with the braces of its literal text doubled)."""
    from rlbridge.data.datasets import escape_template, template_problem

    problem = template_problem(data.template)
    if problem is not None:
        out.append(
            RecipeIssue(
                "data.template",
                problem,
                value=data.template,
                fix=f"double the braces of literal text: template: {escape_template(data.template)!r}",
            )
        )
        return None
    names = {name for _, name, _, _ in string.Formatter().parse(data.template) if name}
    return {re.split(r"[.\[]", name, maxsplit=1)[0] for name in names} - {"prompt"}


def _check_chat_template(data: DataCfg, out: Issues) -> None:
    if not isinstance(data.chat_template, str):
        return
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # transformers brings jinja2; without it the run fails at the tokenizer anyway
        return
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(data.chat_template)
    except Exception as e:  # jinja2.TemplateSyntaxError
        out.append(
            RecipeIssue(
                "data.chat_template",
                f"not a valid Jinja template: {e}",
                fix="give a chat template as in a tokenizer's chat_template (messages, add_generation_prompt), "
                "or true for the tokenizer's own",
            )
        )


def _check_rows(
    r: Recipe, ds: DatasetCfg, which: Literal["train", "val"], template_fields: set[str] | None, out: Issues
) -> None:
    from rlbridge.data.datasets import Columns, Prompt, preview, to_prompt

    data = r.data
    key = f"data.{which}"
    try:
        rows, names = preview(ds, data, split=which, num_rows=PREVIEW_ROWS)
    except DataError as e:
        out.append(_data_issue(e, key))
        return
    except RlbridgeError as e:  # the loaders' messages begin with the key to change ("data.val.split: ...")
        head, _, rest = str(e).partition(": ")
        named = head.startswith("data.") and " " not in head and rest
        out.append(RecipeIssue(head if named else f"{key}.path", rest if named else str(e), value=ds.path))
        return
    if not rows:
        out.append(RecipeIssue(f"{key}.path", "the source has no rows", value=ds.path, origin=chose(key)))
        return
    columns = Columns.of(ds, data, which)
    results: list[tuple[str, Any, Prompt | str]] = [
        (where, row, to_prompt(row, columns) if problem is None else problem) for where, row, problem in rows
    ]
    usable = [(where, row, p) for where, row, p in results if isinstance(p, Prompt)]
    if not usable:
        _no_usable_row(ds, which, columns, results, names, out)
        return
    conversations = [(where, p) for where, _, p in usable if p.messages is not None]
    if conversations and data.template != "{prompt}":
        out.append(
            RecipeIssue(
                "data.template",
                f"applies to string prompts, but {key} {conversations[0][0]}'s {columns.prompt!r} is a "
                "conversation (a list of messages), given to the chat template as it is",
                value=data.template,
                fix="remove data.template (put instructions into the conversation or data.system_prompt)",
                origin=chose(key),
            )
        )
    if conversations and data.chat_template is False:
        out.append(
            RecipeIssue(
                "data.chat_template",
                f"is false, but {key} {conversations[0][0]}'s {columns.prompt!r} is a conversation, which only "
                "a chat template turns into text",
                fix="set data.chat_template: true (the tokenizer's) or a Jinja chat template",
                origin=chose(key),
            )
        )
    _check_reward_columns(r, which, usable[0][0], usable[0][1], columns.prompt, out)
    if template_fields:
        for where, row, p in usable:
            if p.messages is None and _check_template_fields(template_fields, key, where, row, data, out):
                break


def _check_template_fields(
    fields: set[str], key: str, where: str, row: dict[str, Any], data: DataCfg, out: Issues
) -> bool:
    """An issue when data.template names a field the row lacks (True), naming the row and listing its fields."""
    missing = sorted(fields - set(row))
    if not missing:
        return False
    have = ", ".join("{" + f + "}" for f in sorted({*row, "prompt"}))
    out.append(
        RecipeIssue(
            "data.template",
            f"names the field {{{missing[0]}}}, but {key} {where} has no such column",
            value=data.template,
            fix=f"use the row's fields ({have}), or double the braces of literal text",
            origin=chose(key),
        )
    )
    return True


def _check_reward_columns(
    r: Recipe, which: str, where: str, row: dict[str, Any], prompt_column: str, out: Issues
) -> None:
    """A batched (TRL-style) reward function gets the dataset's columns by name: each one it requires (a
    parameter without a default) must be a column of the rows, or every call fails."""
    from rlbridge.data.rewards import BUILTINS, batch_columns_needed, is_batched, resolve_reward_fn

    have = set(row) - {prompt_column}
    for i, term in enumerate(r.reward.resolved_terms()):
        if term.fn is None or term.fn in BUILTINS:
            continue
        try:
            fn = resolve_reward_fn(term.fn, term.batched)
        except RlbridgeError:
            continue  # check_reward reports it
        if not (term.batched if term.batched is not None else is_batched(fn)):
            continue
        missing = [c for c in batch_columns_needed(fn) if c not in have]
        if missing:
            out.append(
                RecipeIssue(
                    "reward.fn" if r.reward.terms is None else f"reward.terms.{i}.fn",
                    f"the batched function takes the column {missing[0]!r} by name, but data.{which} {where} has "
                    f"no such column (columns besides the prompt: {', '.join(sorted(have)) or 'none'})",
                    value=term.fn,
                    fix="rename the dataset column, or give the parameter a default",
                    origin=chose(f"data.{which}"),
                )
            )


def _no_usable_row(
    ds: DatasetCfg,
    which: str,
    columns: Any,
    results: list[tuple[str, Any, Any]],
    names: list[str] | None,
    out: Issues,
) -> None:
    """No row among the first ones is a prompt: blame the column key when the column is missing."""
    where, row, why = results[0]
    have = names if names is not None else sorted(row) if isinstance(row, dict) else None
    listed = f"; its columns: {', '.join(have)}" if have else ""
    for name, which_key in ((columns.prompt, columns.prompt_key), (columns.answer, columns.answer_key)):
        if have is not None and name not in have:
            out.append(
                RecipeIssue(
                    which_key,
                    f"column {name!r} is not in data.{which} ({Path(ds.path).name} {where}{listed})",
                    value=name,
                    fix=f"set {which_key} to the column holding the "
                    f"{'prompt' if which_key == columns.prompt_key else 'reference answer'}, one of: "
                    f"{', '.join(have)}",
                    origin=chose(f"data.{which}"),
                )
            )
            return
    out.append(
        RecipeIssue(
            f"data.{which}.path",
            f"none of the first {len(results)} rows is usable: {where}: {why}{listed}",
            value=ds.path,
            fix="fix the rows, or point data.columns at the prompt and answer columns",
            origin=chose(f"data.{which}"),
        )
    )


def check_eval(r: Recipe, out: Issues) -> None:
    """eval.metrics: terms the reward has, distinct names, a data.val to evaluate on, sampling for pass@k."""
    terms = [t.name for t in r.reward.resolved_terms()]
    seen: dict[str, int] = {}
    for i, m in enumerate(r.eval.metrics):
        key = f"eval.metrics.{i}"
        if m.term != "reward" and m.term not in terms:
            out.append(
                RecipeIssue(
                    f"{key}.term",
                    "not a term of the reward",
                    value=m.term,
                    fix=f"use reward (the weighted sum) or one of the reward's terms: {', '.join(dict.fromkeys(terms))}",
                )
            )
        if m.key in seen:
            out.append(
                RecipeIssue(
                    f"{key}.name",
                    f"eval.metrics.{seen[m.key]} has the same name ({m.key})",
                    fix=f"give one of them another name (eval.metrics.{i}.name)",
                )
            )
        seen.setdefault(m.key, i)
        if m.k > 1 and r.rollout.temperature == 0:
            out.append(
                RecipeIssue(
                    f"{key}.k",
                    f"pass@{m.k} samples {m.k} completions per prompt, but rollout.temperature is 0: all k are the "
                    "same completion",
                    fix="set rollout.temperature > 0, or k: 1",
                )
            )
    # without data.val the metrics still name the training steps' columns (the first pass rate is `acc`); pass@k
    # exists only in evaluations
    if r.data.val is None and any(m.k > 1 for m in r.eval.metrics):
        out.append(
            RecipeIssue(
                "eval.metrics",
                "there is no data.val to evaluate on: pass@k is measured only in evaluations",
                fix="add data.val (e.g. the test split of the training data), or k: 1",
            )
        )
