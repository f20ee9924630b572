"""Reward functions: the protocol, the builtins, and the validation-time check of user functions.

A reward function comes in one of two forms.

Per sample, ``fn(prompt: str, completion: str, sample: dict) -> float``:

- ``prompt`` is the prompt text (the dataset's prompt field, before ``data.template``; a conversation's last
  user message),
- ``completion`` is the decoded model response,
- ``sample`` is the dataset row (``Prompt.sample``: every field of the row, with ``answer`` set to the
  answer column as a string),

and it returns a finite real number.

Batched, as TRL's ``GRPOTrainer`` calls its ``reward_funcs``: ``fn(prompts=[...], completions=[...],
completion_ids=[...], trainer_state=None, log_extra=..., log_metric=..., **columns) -> list[float | None]``,
one call per step with every completion of the batch (each prompt repeated once per sample of its group).
``prompts`` are the dataset's prompts (strings, or message lists for conversational rows), ``completions`` the
decoded responses (strings, or ``[{"role": "assistant", "content": ...}]`` after a conversational prompt), and
every other column of the rows comes as a keyword list (TRL's ``**kwargs``). A None in the result means the
function does not score that sample (TRL's NaN); the other terms still add up. `trainer_state`, `log_extra` and
`log_metric` are given (as None and no-op functions) so that functions which name them run unchanged. A
function is batched when its signature has a ``prompts``, ``completions`` or ``completion_ids`` parameter
(``reward.terms[].batched`` says it explicitly), as every TRL reward function does; it must take ``**kwargs``.

`RewardPool` (reward_pool.py) runs user functions in worker processes and turns exceptions, non-finite or
non-numeric results, hangs and exits into per-sample errors.

The recipe names a function as a builtin (`arithmetic`, `gsm8k`, `format`, `length`) or as
``package.module:function``; `check_reward_fn` imports it and checks its signature during recipe
validation, so a typo fails in seconds instead of at step 300. User modules are imported with the current
directory appended to ``sys.path`` (as ``python -m`` would see it), so ``my_rewards:score`` next to the
recipe works from the console script too.

This module imports only the standard library: recipe validation imports it. The builtins parse numbers
with one strict regular expression and compare them exactly as fractions (``1,234``, ``$1234``,
``1234.00`` and ``1234.`` are all 1234); math-verify is not needed for the integer and decimal answers of
these tasks and would add seconds of import time and signal-based timeouts.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from rlbridge.errors import RlbridgeError

RewardFn = Callable[[str, str, dict[str, Any]], float]
"""fn(prompt, completion, sample) -> float; see the module docstring."""

# A number: optional sign (not after a word character or ")" so "10-5" is 10 and 5), optional "$", digits
# with well-formed thousands separators ("1,234" but "1,2,3" is three numbers), optional decimals. A
# trailing period ("is 5.") is not part of the number.
_NUMBER = re.compile(
    r"(?:(?<![\w)])(?P<sign>-))?\$?(?P<body>(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?)"
)
_MARKER = "####"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s+is\b", re.IGNORECASE)
_SPEC = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


# ------------------------------------------------------------------------------------------ numbers
def _to_fraction(match: re.Match[str]) -> Fraction:
    value = Fraction(match.group("body").replace(",", ""))
    return -value if match.group("sign") else value


def parse_number(text: str) -> Fraction | None:
    """`text` as a number if it is exactly one (surrounding spaces, `$`, a trailing period allowed)."""
    stripped = text.strip().rstrip(".").strip()
    match = _NUMBER.fullmatch(stripped)
    return _to_fraction(match) if match else None


def last_number(text: str) -> Fraction | None:
    """The last number in `text`, or None."""
    matches = list(_NUMBER.finditer(text))
    return _to_fraction(matches[-1]) if matches else None


def _first_number(text: str) -> Fraction | None:
    match = _NUMBER.search(text)
    return _to_fraction(match) if match else None


def number_after_marker(text: str) -> Fraction | None:
    """The number right after the last `####` that is followed by one (`#### $1,234.` is 1234)."""
    parts = text.split(_MARKER)
    for after in reversed(parts[1:]):
        match = _NUMBER.match(after.lstrip())
        if match:
            return _to_fraction(match)
    return None


def extract_answer(completion: str) -> Fraction | None:
    """A completion's final answer: after `####`, else in the last `\\boxed{}`, else after the last
    "answer is", else the last number."""
    value = number_after_marker(completion)
    if value is not None:
        return value
    boxed = _BOXED.findall(completion)
    if boxed and (value := _first_number(boxed[-1])) is not None:
        return value
    said = list(_ANSWER_IS.finditer(completion))
    if said and (value := _first_number(completion[said[-1].end() :])) is not None:
        return value
    return last_number(completion)


def _gold(sample: dict[str, Any]) -> Fraction:
    if "answer" not in sample:
        raise ValueError(f"the sample has no 'answer' field (fields: {sorted(sample)})")
    answer = str(sample["answer"])
    value = number_after_marker(answer) if _MARKER in answer else parse_number(answer)
    if value is None:
        value = last_number(answer)
    if value is None:
        raise ValueError(f"no number in the reference answer {answer[:200]!r}")
    return value


# ----------------------------------------------------------------------------------------- builtins
def arithmetic_reward(prompt: str, completion: str, sample: dict[str, Any]) -> float:
    """1.0 if the number after `####` (else the last number) equals sample['answer'], else 0.0."""
    value = number_after_marker(completion)
    if value is None:
        value = last_number(completion)
    return float(value is not None and value == _gold(sample))


def gsm8k_reward(prompt: str, completion: str, sample: dict[str, Any]) -> float:
    """1.0 if the completion's answer (see `extract_answer`) equals the number after `#### ` in
    sample['answer'] (the whole answer when it has no `####`), else 0.0."""
    value = extract_answer(completion)
    return float(value is not None and value == _gold(sample))


def format_reward(prompt: str, completion: str, sample: dict[str, Any]) -> float:
    """1.0 if the completion contains `####` exactly once, followed by a number; else 0.0."""
    return float(completion.count(_MARKER) == 1 and number_after_marker(completion) is not None)


def length_reward(prompt: str, completion: str, sample: dict[str, Any]) -> float:
    """min(len(completion), 100) / 100. Not a task reward: a graded signal that even a random model gets,
    so smoke runs (recipes/smoke-megatron-cpu.yaml, `rlbridge train --smoke`) have gradients to check."""
    return min(len(completion), 100) / 100.0


BUILTINS: dict[str, RewardFn] = {
    "arithmetic": arithmetic_reward,
    "gsm8k": gsm8k_reward,
    "format": format_reward,
    "length": length_reward,
}


# ---------------------------------------------------------------------------------- user functions
def _import_attr(module_name: str, attr: str) -> tuple[Any, str | None]:
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # a user module may raise anything, even SystemExit
        return None, f"cannot import module {module_name!r}: {type(e).__name__}: {e}"
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = ".".join([module_name, *attr.split(".")[:i]])
            return None, f"{where} has no attribute {part!r}"
        obj = getattr(obj, part)
    return obj, None


BATCH_NAMES = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""The keyword arguments TRL's GRPOTrainer gives every reward function besides the dataset's columns."""


def is_batched(fn: Any) -> bool:
    """Whether `fn` is a TRL-style batched reward function: it names a `prompts`, `completions` or
    `completion_ids` parameter."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in ("prompts", "completions", "completion_ids"))


def batch_columns_needed(fn: Any) -> list[str]:
    """The dataset columns a batched function requires by name (parameters without defaults, besides TRL's)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.name not in BATCH_NAMES
        and p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def _signature_problem(fn: Any, spec: str, batched: bool | None = None) -> str | None:
    if not callable(fn):
        return f"{spec} is a {type(fn).__name__}, not a function"
    if inspect.iscoroutinefunction(fn):
        return f"{spec} is async; reward functions must be plain functions returning a float"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # no introspectable signature (some C callables): checked when called
    if batched if batched is not None else is_batched(fn):
        kinds = {p.name: p.kind for p in sig.parameters.values()}
        keywords = any(k is inspect.Parameter.VAR_KEYWORD for k in kinds.values())
        if not keywords:
            return (
                f"{spec}{sig} is batched but takes no **kwargs: TRL's form is fn(prompts, completions, **kwargs), "
                "called with every column of the dataset"
            )
        if any(k is inspect.Parameter.POSITIONAL_ONLY for k in kinds.values()):
            return (
                f"{spec}{sig} is batched: its arguments are passed by keyword, so none may be positional-only"
            )
        return None
    try:
        sig.bind("prompt", "completion", {})
    except TypeError:
        return (
            f"{spec}{sig} must accept 3 positional arguments (prompt, completion, sample), or be batched as "
            "TRL's reward functions are (prompts=..., completions=..., **columns)"
        )
    return None


def _load(spec: Any, batched: bool | None = None) -> tuple[RewardFn | None, str | None]:
    if not isinstance(spec, str) or not spec.strip():
        return None, f"a reward function must be a builtin name or package.module:function, got {spec!r}"
    if spec in BUILTINS:
        if batched:
            return None, f"the builtin {spec!r} scores one sample at a time; remove batched: true"
        return BUILTINS[spec], None
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(BUILTINS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return None, f"unknown builtin reward {spec!r}{hint}; builtins: {', '.join(BUILTINS)}"
    match = _SPEC.fullmatch(spec.strip())
    if not match:
        return None, f"{spec!r} is not of the form package.module:function"
    fn, problem = _import_attr(match.group("module"), match.group("attr"))
    return (None, problem) if problem else (fn, _signature_problem(fn, spec, batched))


def check_reward_fn(spec: str, batched: bool | None = None) -> str | None:
    """None if `spec` names a usable reward function (batched: None detects the form from its signature),
    else what is wrong with it. Never raises."""
    try:
        return _load(spec, batched)[1]
    except Exception as e:  # belt and braces: validation must report, not crash
        return f"cannot check {spec!r}: {type(e).__name__}: {e}"


def resolve_reward_fn(spec: str, batched: bool | None = None) -> RewardFn:
    """The function `spec` names; RlbridgeError with check_reward_fn's message if it is not usable."""
    fn, problem = _load(spec, batched)
    if problem or fn is None:
        raise RlbridgeError(f"reward function {spec!r}: {problem}")
    return fn


def _no_op(*args: Any, **kwargs: Any) -> None:
    """TRL's log_extra / log_metric, given so that functions calling them run; rlbridge logs nothing of theirs."""


def batch_kwargs(
    prompts: list[Any],
    completions: list[str],
    rows: list[dict[str, Any]],
    *,
    prompt_column: str | None = None,
    completion_ids: list[list[int]] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of a batched reward call, as TRL's GRPOTrainer builds them: `prompts` (each prompt
    as the dataset has it: a string or a message list), `completions` (a string, or one assistant message after a
    conversational prompt), `completion_ids`, and every other column of the rows (the prompt column excluded) as
    a list. `call_batched` adds TRL's trainer_state / log_extra / log_metric."""
    conversational = [isinstance(p, list) for p in prompts]
    out: dict[str, Any] = {
        "prompts": prompts,
        "completions": [
            [{"role": "assistant", "content": c}] if conv else c
            for c, conv in zip(completions, conversational, strict=True)
        ],
        "completion_ids": completion_ids if completion_ids is not None else [[] for _ in completions],
    }
    skip = {prompt_column, "prompt", "completion", *BATCH_NAMES}
    for key in dict.fromkeys(k for row in rows for k in row):
        if key not in skip:
            out[key] = [row.get(key) for row in rows]
    return out


def call_batched(fn: Any, kwargs: dict[str, Any]) -> list[Any]:
    """One batched call, TRL's way: the batch's keyword lists plus trainer_state (None here), log_extra and
    log_metric (no-ops); returns what the function returns, checked to be one value per completion."""
    n = len(kwargs["completions"])
    out = fn(**kwargs, trainer_state=None, log_extra=_no_op, log_metric=_no_op)
    if isinstance(out, str | bytes | dict) or not hasattr(out, "__len__") or len(out) != n:
        raise TypeError(
            f"a batched reward function must return one reward per completion ({n}), got "
            f"{type(out).__name__} {str(out)[:100]!r}"
        )
    return list(out)
