"""Loading: the rows of one split as `Prompt`s, and why a row is not one.

A .jsonl or .parquet file of at most WHOLE_FILE_BYTES (data.<split>.loader auto, or any size with loader memory)
and `builtin:arithmetic` are read whole into a list of `Prompt`s, forgiving per row and strict per file: a
malformed row (not an object, a missing key, an empty or non-string prompt, invalid JSON or UTF-8) is skipped and
counted, with the line numbers of the first few, but a file with no usable row, a missing file or a missing
column is an `RlbridgeError` naming the recipe key to change. Every other source goes through Hugging Face datasets
(hf_datasets.py) and stays on disk, memory-mapped (`open_prompts`).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from rlbridge.data.arithmetic import arithmetic_rows
from rlbridge.data.hf_datasets import check_single_file
from rlbridge.data.json_array import array_rows, is_json_array
from rlbridge.errors import DataError, RlbridgeError
from rlbridge.recipe.schema import DataCfg, DatasetCfg

if TYPE_CHECKING:
    from rlbridge.data.hf_datasets import LazyPrompts

log = logging.getLogger(__name__)
Split = Literal["train", "val"]
MAX_EXAMPLES = 5
"""Skipped rows described with their reason (the rest are counted), and unusable rows logged one by one."""
_PARQUET_BATCH_ROWS = 4096
WHOLE_FILE_BYTES = 64 * 1024**2
"""The largest .jsonl / .parquet file loader auto reads whole into memory; a larger one goes through Hugging Face
datasets (memory-mapped). Read whole, a row costs several times its size in Python objects and every prompt is
tokenized at start."""


@dataclass(frozen=True)
class Prompt:
    text: str
    """The prompt field of the row (before data.template); for a conversation, its last user message."""
    answer: str
    """The answer field of the row, as a string."""
    row: dict[str, Any]
    """The whole row (JSON-able): its fields are available to data.template and to reward functions."""
    messages: list[dict[str, str]] | None = None
    """The prompt as a conversation (`{role, content}` messages), when the row's prompt is one."""

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
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {why}")

    def __str__(self) -> str:
        more = f" (and {self.count - len(self.examples)} more)" if self.count > len(self.examples) else ""
        return f"{self.count} row(s) skipped: " + "; ".join(self.examples) + more


class Columns(NamedTuple):
    """The columns of one split that are the prompt and the answer, with the recipe keys naming them."""

    prompt: str
    prompt_key: str
    answer: str
    answer_key: str

    @classmethod
    def of(cls, cfg: DatasetCfg, data_cfg: DataCfg, split: str) -> Columns:
        (prompt, prompt_key), (answer, answer_key) = data_cfg.keys(cfg, split)
        return cls(prompt, prompt_key, answer, answer_key)


def uses_datasets(cfg: DatasetCfg) -> bool:
    """Whether the source is read through Hugging Face datasets (hf_datasets.py) rather than whole into memory:
    loader datasets, any source but a .jsonl or .parquet file, or (loader auto) such a file over
    WHOLE_FILE_BYTES."""
    if cfg.path.startswith("builtin:") or cfg.loader == "memory":
        return False
    path = Path(cfg.path).expanduser()
    if cfg.loader == "datasets" or path.suffix.lower() not in (".jsonl", ".parquet"):
        return True
    return path.is_file() and path.stat().st_size > WHOLE_FILE_BYTES


def load_dataset(cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int) -> list[Prompt]:
    """The usable prompts of one split; skipped rows are logged as a warning (see `read_dataset`)."""
    prompts, skipped = read_dataset(cfg, data_cfg, split=split, seed=seed)
    if skipped.count:
        log.warning("data.%s (%s): %s", split, cfg.path, skipped)
    return prompts


def open_prompts(
    cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int
) -> list[Prompt] | LazyPrompts:
    """What a run samples from: a list (read whole, `load_dataset`), or a source read through Hugging Face
    datasets, whose rows stay on disk until sampled."""
    if not uses_datasets(cfg):
        return load_dataset(cfg, data_cfg, split=split, seed=seed)
    from rlbridge.data.hf_datasets import LazyPrompts, open_split

    columns = Columns.of(cfg, data_cfg, split)
    found = open_split(cfg, split)
    lazy = LazyPrompts(found, lambda row: to_prompt(row, columns), f"data.{split} ({cfg.path})")
    if not len(lazy):
        raise RlbridgeError(f"data.{split}.path: {cfg.path} has no rows")
    for name, which in ((columns.prompt, columns.prompt_key), (columns.answer, columns.answer_key)):
        if name not in found.column_names:
            raise RlbridgeError(
                f"{which}: column {name!r} not in {cfg.path} (columns: {', '.join(found.column_names)}); "
                f"set {which} to one of them"
            )
    return lazy


def read_dataset(
    cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int
) -> tuple[list[Prompt], Skipped]:
    """The usable prompts of one split (at most cfg.limit) and the rows skipped on the way."""
    key = f"data.{split}"
    if cfg.path.startswith("builtin:"):
        return _builtin_prompts(cfg, data_cfg, split=split, seed=seed), Skipped()
    columns = Columns.of(cfg, data_cfg, split)
    if uses_datasets(cfg):
        lazy = open_prompts(cfg, data_cfg, split=split, seed=seed)
        assert not isinstance(lazy, list)
        rows: Iterator[tuple[str, Any, str | None]] = ((w, r, None) for w, r in lazy.rows())
    else:
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise RlbridgeError(
                f"{key}.path: file not found: {cfg.path} (relative paths are from the current directory)"
            )
        check_single_file(cfg, key)
        rows = (
            _jsonl_rows(path) if path.suffix.lower() == ".jsonl" else _parquet_rows(path, cfg, key, columns)
        )
    prompts, skipped = _collect(rows, cfg, columns)
    if not prompts:
        why = str(skipped) if skipped.count else "the file has no rows"
        raise RlbridgeError(
            f"{key}.path: no usable row in {cfg.path} with {columns.prompt_key}={columns.prompt!r} and "
            f"{columns.answer_key}={columns.answer!r}: {why}"
        )
    return prompts, skipped


def preview(
    cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, num_rows: int
) -> tuple[list[tuple[str, Any, str | None]], list[str] | None]:
    """The first `num_rows` rows of a file or dataset as (where, row, problem reading it), and the column names
    where the format has them: what validate-recipe checks, reading only the start of the source."""
    key = f"data.{split}"
    path = Path(cfg.path).expanduser()
    # A .jsonl / .parquet file (or a .json array) is previewed by the row readers under any loader: they read the
    # first rows only, where datasets' streaming parses a 10 MB chunk of JSON, a whole parquet row group, or a whole
    # JSON array first.
    array = path.is_file() and path.suffix.lower() == ".json" and is_json_array(path)
    own_reader = array or (path.is_file() and path.suffix.lower() in (".jsonl", ".parquet"))
    if uses_datasets(cfg) and not own_reader:
        from rlbridge.data.hf_datasets import preview as hf_preview

        rows, names = hf_preview(cfg, split, num_rows)
        return [(f"row {i + 1}", row, None) for i, row in enumerate(rows)], names
    if not path.is_file():
        raise RlbridgeError(
            f"{key}.path: file not found: {cfg.path} (relative paths are from the current directory)"
        )
    check_single_file(cfg, key)
    if array:
        return array_rows(path, key, num_rows), None
    if path.suffix.lower() == ".jsonl":
        return list(itertools.islice(_jsonl_rows(path), num_rows)), None
    columns = Columns.of(cfg, data_cfg, split)
    return list(itertools.islice(_parquet_rows(path, cfg, key, columns), num_rows)), None


def check_builtin(cfg: DatasetCfg, key: str) -> None:
    """builtin:arithmetic has no splits or configurations to choose: a data.<split>.split or .config is an error,
    never ignored."""
    for name in ("split", "config"):
        if getattr(cfg, name) is not None:
            raise DataError(
                f"{key}.{name}",
                f"builtin:arithmetic has no {name}s: data.train and data.val each generate their own rows "
                "(data.arithmetic, seeded apart)",
                f"remove {key}.{name}",
                value=getattr(cfg, name),
            )


def _builtin_prompts(cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int) -> list[Prompt]:
    key = f"data.{split}"
    if cfg.path != "builtin:arithmetic":
        raise RlbridgeError(
            f"{key}.path: unknown builtin dataset {cfg.path!r}; the builtin is builtin:arithmetic"
        )
    check_builtin(cfg, key)
    if (Columns.of(cfg, data_cfg, split)[::2]) != ("question", "answer"):
        log.warning(
            "%s.prompt_key / answer_key (data.columns) are ignored for builtin:arithmetic (its rows have question, "
            "answer, a, op, b)",
            key,
        )
    rows = arithmetic_rows(data_cfg.arithmetic, split=split, seed=seed)[: cfg.limit]
    return [Prompt(text=r["question"], answer=r["answer"], row=r) for r in rows]


def _collect(
    rows: Iterator[tuple[str, Any, str | None]], cfg: DatasetCfg, columns: Columns
) -> tuple[list[Prompt], Skipped]:
    prompts: list[Prompt] = []
    skipped = Skipped()
    for where, row, problem in rows:
        result = to_prompt(row, columns) if problem is None else problem
        if isinstance(result, Prompt):
            prompts.append(result)
            if cfg.limit is not None and len(prompts) >= cfg.limit:
                break
        else:
            skipped.add(where, result)
    return prompts, skipped


def conversation(value: list[Any]) -> list[dict[str, str]] | str:
    """A prompt given as messages (TRL's conversational format), checked; or why it is not one."""
    if not value:
        return "an empty conversation"
    out: list[dict[str, str]] = []
    for j, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            return f"message {j} is not a {{role, content}} object of strings"
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant":
        return (
            "the conversation ends with an assistant message (the prompt must leave the answer to the model)"
        )
    return out


def to_prompt(row: Any, columns: Columns) -> Prompt | str:
    """The row as a Prompt, or why it is unusable."""
    if not isinstance(row, dict):
        return f"not a JSON object but {type(row).__name__}"
    if columns.prompt not in row:
        return f"missing {columns.prompt!r} ({columns.prompt_key})"
    if columns.answer not in row:
        return f"missing {columns.answer!r} ({columns.answer_key})"
    text, answer = row[columns.prompt], row[columns.answer]
    messages: list[dict[str, str]] | None = None
    if isinstance(text, list):
        checked = conversation(text)
        if isinstance(checked, str):
            return f"{columns.prompt!r}: {checked}"
        messages = checked
        users = [m["content"] for m in messages if m["role"] == "user"]
        text = users[-1] if users else messages[-1]["content"]
    elif not isinstance(text, str):
        return f"{columns.prompt!r} is {type(text).__name__}, not a string or a list of messages"
    elif not text.strip():
        return f"empty {columns.prompt!r}"
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return f"{columns.answer!r} is {type(answer).__name__}, not a string or a number"
    return Prompt(text=text, answer=str(answer), row=row, messages=messages)


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


def _parquet_rows(
    path: Path, cfg: DatasetCfg, key: str, columns: Columns
) -> Iterator[tuple[str, Any, str | None]]:
    """(where, row, problem) per row, read in batches (pyarrow is imported here only)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise RlbridgeError(f"{key}.path: reading .parquet needs pyarrow (pip install pyarrow)") from e
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid family for corrupt files
        raise RlbridgeError(f"{key}.path: cannot read {cfg.path} as parquet: {e}") from e
    names = file.schema_arrow.names
    for name, which in ((columns.prompt, columns.prompt_key), (columns.answer, columns.answer_key)):
        if name not in names:
            raise RlbridgeError(f"{which}: column {name!r} not in {cfg.path} (columns: {', '.join(names)})")
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
