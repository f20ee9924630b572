"""Prompts: load them (jsonl, parquet, builtin:arithmetic), render and tokenize them, and sample them.

Loading is forgiving per row and strict per file: a malformed row (not an object, a missing key, an empty or
non-string prompt, invalid JSON or UTF-8) is skipped and counted, with the line numbers of the first few,
but a file with no usable row, a missing file or a missing column is an `RlbridgeError` naming the recipe
key to change. `PromptSampler` shuffles per epoch from (seed, epoch) alone, so its whole state is four
integers and a resumed run sees exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlbridge.data.arithmetic import arithmetic_rows
from rlbridge.errors import RecipeIssue, RlbridgeError
from rlbridge.recipe.schema import DataCfg, DatasetCfg

log = logging.getLogger(__name__)
Split = Literal["train", "val"]
_MAX_EXAMPLES = 5
_PARQUET_BATCH_ROWS = 4096
PREVIEW_ROWS = 100
"""Rows `check_rows` reads at validation (the first ones of each split)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    """The prompt field of the row (before data.template)."""
    answer: str
    """The answer field of the row, as a string."""
    row: dict[str, Any]
    """The whole row (JSON-able): its fields are available to data.template and to reward functions."""

    @property
    def sample(self) -> dict[str, Any]:
        """What reward functions receive: the row, with `answer` set to this prompt's answer."""
        return {**self.row, "answer": self.answer}


@dataclass
class Skipped:
    """Rows skipped while loading: how many, and where and why for the first few."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, why: str) -> None:
        self.count += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(f"{where}: {why}")

    def __str__(self) -> str:
        more = f" (and {self.count - len(self.examples)} more)" if self.count > len(self.examples) else ""
        return f"{self.count} row(s) skipped: " + "; ".join(self.examples) + more


# -------------------------------------------------------------------------------------------- loading
def load_dataset(cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int) -> list[Prompt]:
    """The usable prompts of one split; skipped rows are logged as a warning (see `read_dataset`)."""
    prompts, skipped = read_dataset(cfg, data_cfg, split=split, seed=seed)
    if skipped.count:
        log.warning("data.%s (%s): %s", split, cfg.path, skipped)
    return prompts


def read_dataset(
    cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int
) -> tuple[list[Prompt], Skipped]:
    """The usable prompts of one split (at most cfg.limit) and the rows skipped on the way."""
    key = f"data.{split}"
    if cfg.path.startswith("builtin:"):
        return _builtin_prompts(cfg, data_cfg, split=split, seed=seed), Skipped()
    path = Path(cfg.path).expanduser()
    if path.suffix not in (".jsonl", ".parquet"):
        raise RlbridgeError(
            f"{key}.path: unsupported format {path.suffix or '(none)'!r} ({cfg.path}); use .jsonl or .parquet"
        )
    if not path.is_file():
        raise RlbridgeError(
            f"{key}.path: file not found: {cfg.path} (relative paths are from the current directory)"
        )
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path, cfg, key)
    prompts, skipped = _collect(rows, cfg, key)
    if not prompts:
        why = str(skipped) if skipped.count else "the file has no rows"
        raise RlbridgeError(
            f"{key}.path: no usable row in {cfg.path} with {key}.prompt_key={cfg.prompt_key!r} and "
            f"{key}.answer_key={cfg.answer_key!r}: {why}"
        )
    return prompts, skipped


def _builtin_prompts(cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int) -> list[Prompt]:
    key = f"data.{split}"
    if cfg.path != "builtin:arithmetic":
        raise RlbridgeError(
            f"{key}.path: unknown builtin dataset {cfg.path!r}; the builtin is builtin:arithmetic"
        )
    if (cfg.prompt_key, cfg.answer_key) != ("question", "answer"):
        log.warning(
            "%s.prompt_key / answer_key are ignored for builtin:arithmetic (its rows have question, "
            "answer, a, op, b)",
            key,
        )
    rows = arithmetic_rows(data_cfg.arithmetic, split=split, seed=seed)[: cfg.limit]
    return [Prompt(text=r["question"], answer=r["answer"], row=r) for r in rows]


def _collect(
    rows: Iterator[tuple[str, Any, str | None]], cfg: DatasetCfg, key: str
) -> tuple[list[Prompt], Skipped]:
    prompts: list[Prompt] = []
    skipped = Skipped()
    for where, row, problem in rows:
        result = _to_prompt(row, cfg, key) if problem is None else problem
        if isinstance(result, Prompt):
            prompts.append(result)
            if cfg.limit is not None and len(prompts) >= cfg.limit:
                break
        else:
            skipped.add(where, result)
    return prompts, skipped


def _to_prompt(row: Any, cfg: DatasetCfg, key: str) -> Prompt | str:
    """The row as a Prompt, or why it is unusable."""
    if not isinstance(row, dict):
        return f"not a JSON object but {type(row).__name__}"
    if cfg.prompt_key not in row:
        return f"missing {cfg.prompt_key!r} ({key}.prompt_key)"
    if cfg.answer_key not in row:
        return f"missing {cfg.answer_key!r} ({key}.answer_key)"
    text, answer = row[cfg.prompt_key], row[cfg.answer_key]
    if not isinstance(text, str):
        return f"{cfg.prompt_key!r} is {type(text).__name__}, not a string"
    if not text.strip():
        return f"empty {cfg.prompt_key!r}"
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return f"{cfg.answer_key!r} is {type(answer).__name__}, not a string or a number"
    return Prompt(text=text, answer=str(answer), row=row)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(where, row, problem) per non-blank line."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"line {number}"
            try:
                yield where, json.loads(raw.decode("utf-8")), None
            except UnicodeDecodeError as e:
                yield where, None, f"invalid UTF-8 at byte {e.start}"
            except json.JSONDecodeError as e:
                yield where, None, f"invalid JSON ({e.msg} at column {e.colno})"


def _parquet_rows(path: Path, cfg: DatasetCfg, key: str) -> Iterator[tuple[str, Any, str | None]]:
    """(where, row, problem) per row, read in batches (pyarrow is imported here only)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise RlbridgeError(f"{key}.path: reading .parquet needs pyarrow (pip install pyarrow)") from e
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid family for corrupt files
        raise RlbridgeError(f"{key}.path: cannot read {cfg.path} as parquet: {e}") from e
    columns = file.schema_arrow.names
    for name, which in ((cfg.prompt_key, "prompt_key"), (cfg.answer_key, "answer_key")):
        if name not in columns:
            raise RlbridgeError(
                f"{key}.{which}: column {name!r} not in {cfg.path} (columns: {', '.join(columns)})"
            )
    number = 0
    for batch in file.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            number += 1
            try:
                json.dumps(row)
            except (TypeError, ValueError) as e:
                yield f"row {number}", None, f"not JSON-serializable ({e})"
                continue
            yield f"row {number}", row, None


# -------------------------------------------------------------------------------------- formatting
def template_problem(template: str) -> str | None:
    """Why str.format cannot fill `template` from a row's fields by name (a lone brace, a placeholder that is
    not a field name such as the `{"answer": 1}` of a JSON example, a positional `{}`), or None."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        return f"str.format cannot read it ({e})"
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        base = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not base.isidentifier():
            text = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            return (
                f"str.format reads {text!r} as a placeholder for a field named {base!r}, which no row has "
                "(placeholders are {prompt} and {field} of the row)"
            )
    return None


_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{[A-Za-z_][A-Za-z0-9_]*\}|[{}]")


def escape_template(template: str) -> str:
    """`template` with every brace doubled except those of `{field}` placeholders and already doubled ones: what
    a template with literal braces (a JSON example) should say."""
    return _PLACEHOLDER.sub(lambda m: m.group(0) * 2 if m.group(0) in "{}" else m.group(0), template)


def check_rows(
    cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int, limit: int = PREVIEW_ROWS
) -> list[RecipeIssue]:
    """What a run would meet in its first rows, found at validation: no usable row among the first `limit`
    (the prompt or answer field missing: issue on data.<split>.prompt_key / answer_key, naming the row and
    the fields it has), or a data.template the first usable row cannot fill. The file's existence and format
    are checked before (recipe/checks/files.py)."""
    key = f"data.{split}"
    try:
        if cfg.path.startswith("builtin:"):
            rows: Iterator[tuple[str, Any, str | None]] = iter(
                (f"row {i + 1}", r, None)
                for i, r in enumerate(arithmetic_rows(data_cfg.arithmetic, split=split, seed=seed)[:limit])
            )
            cfg = cfg.model_copy(update={"prompt_key": "question", "answer_key": "answer"})  # its rows' names
        else:
            path = Path(cfg.path).expanduser()
            rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path, cfg, key)
        first: list[tuple[str, Any, str | None]] = []
        for item in rows:
            first.append(item)
            if len(first) >= limit:
                break
    except RlbridgeError as e:  # unreadable file, or a parquet file without the column
        which, _, message = str(e).partition(": ")
        return [RecipeIssue(which if which.startswith(key) else f"{key}.path", message or str(e))]
    usable = [
        (where, p)
        for where, row, problem in first
        if problem is None and isinstance(p := _to_prompt(row, cfg, key), Prompt)
    ]
    if not usable:
        return [_unusable(cfg, key, first)]
    where, prompt = usable[0]
    if template_problem(data_cfg.template) is not None:
        return []  # reported on its own (recipe/checks/files.py)
    try:
        render_messages(prompt, data_cfg)
    except RlbridgeError as e:
        fields = ", ".join("{" + f + "}" for f in sorted({**prompt.row, "prompt": 0}))
        return [
            RecipeIssue(
                "data.template",
                f"{e} ({cfg.path} {where})",
                fix=f"use the row's fields ({fields}), or double the braces of literal text",
            )
        ]
    return []


def _unusable(cfg: DatasetCfg, key: str, first: list[tuple[str, Any, str | None]]) -> RecipeIssue:
    """The issue of a source whose first rows hold no usable prompt: the field that is missing everywhere, or
    the reasons of the first rows."""
    n = len(first)
    if n == 0:
        return RecipeIssue(f"{key}.path", f"{cfg.path} has no rows", fix="point it at a file with rows")
    objects = [(where, row) for where, row, problem in first if problem is None and isinstance(row, dict)]
    for name, which in ((cfg.prompt_key, "prompt_key"), (cfg.answer_key, "answer_key")):
        if objects and all(name not in row for _, row in objects):
            where, row = objects[0]
            have = sorted(str(k) for k in row)
            return RecipeIssue(
                f"{key}.{which}",
                f"none of the first {n} row(s) of {cfg.path} has the field {name!r} ({where} has: {', '.join(have)})",
                fix=f"set {key}.{which} to one of: {', '.join(have)}",
            )
    reasons = Skipped()
    for where, row, problem in first:
        result = problem if problem is not None else _to_prompt(row, cfg, key)
        if isinstance(result, str):
            reasons.add(where, result)
    return RecipeIssue(
        f"{key}.path",
        f"none of the first {n} rows of {cfg.path} is usable: {reasons}",
        value=cfg.path,
        fix=f"fix the rows, or point {key}.prompt_key / answer_key at fields that hold the prompt and answer",
    )


def render_messages(prompt: Prompt, data_cfg: DataCfg) -> list[dict[str, str]]:
    """[system (if data.system_prompt)], user = data.template with {prompt} and the row's fields."""
    fields = {**prompt.row, "prompt": prompt.text}
    try:
        user = data_cfg.template.format_map(fields)
    except KeyError as e:
        raise RlbridgeError(
            f"data.template names the field {e} but the row has only {', '.join(sorted(fields))}"
        ) from e
    except (IndexError, ValueError, AttributeError) as e:
        raise RlbridgeError(
            f"data.template {data_cfg.template!r} is not a valid format string: {e}; "
            "use {prompt} and {field} placeholders (double braces for literal ones)"
        ) from e
    messages = [{"role": "system", "content": data_cfg.system_prompt}] if data_cfg.system_prompt else []
    return [*messages, {"role": "user", "content": user}]


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except ValueError as e:  # transformers: "Cannot use chat template functions because ... not set"
        raise RlbridgeError(
            f"data.chat_template: the tokenizer cannot apply a chat template ({e}); "
            "set data.chat_template: false to encode the plain text"
        ) from e
    ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5 may return a BatchEncoding
    if len(ids) and isinstance(ids[0], list | tuple):
        ids = ids[0]
    return [int(t) for t in ids]


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], data_cfg: DataCfg, max_prompt_tokens: int
) -> tuple[list[list[int]], list[Prompt], int]:
    """Token ids of each prompt (chat template with the generation prompt, or the plain text with the
    system prompt and a blank line in front), dropping those longer than max_prompt_tokens.

    Returns (ids of the kept prompts, the kept prompts, how many were dropped)."""
    ids_kept: list[list[int]] = []
    kept: list[Prompt] = []
    for prompt in prompts:
        messages = render_messages(prompt, data_cfg)
        if data_cfg.chat_template:
            ids = _chat_ids(tokenizer, messages)
        else:
            ids = [int(t) for t in tokenizer.encode("\n\n".join(m["content"] for m in messages))]
        if len(ids) <= max_prompt_tokens:
            ids_kept.append(ids)
            kept.append(prompt)
    return ids_kept, kept, len(prompts) - len(kept)


# --------------------------------------------------------------------------------------- sampling
def fingerprint(prompts: Sequence[Prompt]) -> str:
    """A short hash of the prompts and answers, to refuse resuming on different data."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(
            p.text.encode("utf-8", "surrogatepass")
            + b"\0"
            + p.answer.encode("utf-8", "surrogatepass")
            + b"\0"
        )
    return digest.hexdigest()[:16]


class PromptSampler:
    """Endless batches of prompts, reshuffled every epoch from (seed, epoch); resumable exactly.

    A batch that runs past the end of an epoch takes the rest from the start of the next epoch's order.
    """

    def __init__(self, prompts: Sequence[Prompt], *, seed: int, shuffle: bool = True) -> None:
        if not prompts:
            raise RlbridgeError("no prompts to sample from")
        self.prompts = list(prompts)
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.index = 0, 0
        self._fingerprint = fingerprint(self.prompts)
        self._order_epoch, self._order = -1, list[int]()

    def order(self, epoch: int) -> list[int]:
        """The prompt indices of one epoch, in sampling order."""
        if epoch != self._order_epoch:
            self._order = list(range(len(self.prompts)))
            if self.shuffle:  # a str seed is hashed with sha512: the same in every process and Python version
                random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def next_indices(self, batch_size: int) -> list[int]:
        """Positions in `prompts` of the next batch (to index parallel lists such as token ids)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        batch: list[int] = []
        while len(batch) < batch_size:
            order = self.order(self.epoch)
            take = order[self.index : self.index + batch_size - len(batch)]
            batch.extend(take)
            self.index += len(take)
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return batch

    def next_batch(self, batch_size: int) -> list[Prompt]:
        """The next batch of prompts."""
        return [self.prompts[i] for i in self.next_indices(batch_size)]

    def state(self) -> dict[str, Any]:
        """JSON-able position: resume with `load_state`."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "index": self.index,
            "size": len(self.prompts),
            "fingerprint": self._fingerprint,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (from `state()`); refuses a state recorded on different data."""
        size = state.get("size")
        if size != len(self.prompts):
            raise RlbridgeError(
                f"the checkpoint's data position is for {size} prompts but the dataset now has "
                f"{len(self.prompts)}; resuming would not reproduce the data order. Restore "
                "data.train.path and data.train.limit of the original run"
            )
        if state.get("fingerprint", self._fingerprint) != self._fingerprint:
            raise RlbridgeError(
                "the checkpoint's data position is for different prompts (same count, different "
                "content); restore the original data.train.path file to resume"
            )
        if not (
            isinstance(state.get("epoch"), int)
            and isinstance(state.get("index"), int)
            and state["epoch"] >= 0
            and 0 <= state["index"] <= size
        ):
            raise RlbridgeError(f"invalid data position in the checkpoint: {dict(state)}")
        if (state.get("seed", self.seed), state.get("shuffle", self.shuffle)) != (self.seed, self.shuffle):
            log.warning(
                "data order follows the checkpoint (seed %s, shuffle %s), not run.seed %s / data.shuffle %s",
                state.get("seed"),
                state.get("shuffle"),
                self.seed,
                self.shuffle,
            )
        self.seed, self.shuffle = state.get("seed", self.seed), state.get("shuffle", self.shuffle)
        self.epoch, self.index = state["epoch"], state["index"]
        self._order_epoch = -1
        if self.index == size:
            self.epoch, self.index = self.epoch + 1, 0
