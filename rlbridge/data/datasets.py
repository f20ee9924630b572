"""Prompts: load them, render and tokenize them, and sample them.

Two ways in. A .jsonl or .parquet file (data.<split>.loader auto) and `builtin:arithmetic` are read whole into
a list of `Prompt`s, forgiving per row and strict per file: a malformed row (not an object, a missing key, an
empty or non-string prompt, invalid JSON or UTF-8) is skipped and counted, with the line numbers of the first
few, but a file with no usable row, a missing file or a missing column is an `RlbridgeError` naming the recipe
key to change. Every other source (Hub datasets, .json, .csv, folders; or any file with loader datasets) goes
through Hugging Face datasets (hf_datasets.py) and stays on disk: `LazyEncoded` reads and tokenizes a row when
the sampler reaches it, and the sampler passes over rows that cannot be prompts.

A prompt is a string (rendered with data.template into a user message) or a conversation (a list of
`{role, content}` messages, TRL's conversational format), given to the chat template as it is.

`PromptSampler` shuffles per epoch from (seed, epoch) alone, so its whole state is four integers and a resumed
run sees exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import re
import string
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from rlbridge.data.arithmetic import arithmetic_rows
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import DataCfg, DatasetCfg

if TYPE_CHECKING:
    from rlbridge.data.hf_datasets import LazyPrompts

log = logging.getLogger(__name__)
Split = Literal["train", "val"]
_MAX_EXAMPLES = 5
_PARQUET_BATCH_ROWS = 4096


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
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(f"{where}: {why}")

    def __str__(self) -> str:
        more = f" (and {self.count - len(self.examples)} more)" if self.count > len(self.examples) else ""
        return f"{self.count} row(s) skipped: " + "; ".join(self.examples) + more


# -------------------------------------------------------------------------------------------- loading
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
    """Whether the source is read through Hugging Face datasets (hf_datasets.py) rather than row by row."""
    if cfg.path.startswith("builtin:"):
        return False
    return cfg.loader == "datasets" or Path(cfg.path).suffix.lower() not in (".jsonl", ".parquet")


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
        rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path, cfg, key, columns)
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
    if uses_datasets(cfg):
        from rlbridge.data.hf_datasets import preview as hf_preview

        rows, names = hf_preview(cfg, split, num_rows)
        return [(f"row {i + 1}", row, None) for i, row in enumerate(rows)], names
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise RlbridgeError(
            f"{key}.path: file not found: {cfg.path} (relative paths are from the current directory)"
        )
    if path.suffix == ".jsonl":
        return list(itertools.islice(_jsonl_rows(path), num_rows)), None
    columns = Columns.of(cfg, data_cfg, split)
    return list(itertools.islice(_parquet_rows(path, cfg, key, columns), num_rows)), None


def _builtin_prompts(cfg: DatasetCfg, data_cfg: DataCfg, *, split: Split, seed: int) -> list[Prompt]:
    key = f"data.{split}"
    if cfg.path != "builtin:arithmetic":
        raise RlbridgeError(
            f"{key}.path: unknown builtin dataset {cfg.path!r}; the builtin is builtin:arithmetic"
        )
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


def render_messages(prompt: Prompt, data_cfg: DataCfg) -> list[dict[str, str]]:
    """[system (if data.system_prompt)], user = data.template with {prompt} and the row's fields; a conversation
    as it is (data.system_prompt in front when it has no system message)."""
    system = [{"role": "system", "content": data_cfg.system_prompt}] if data_cfg.system_prompt else []
    if prompt.messages is not None:
        has_system = any(m["role"] == "system" for m in prompt.messages)
        return [*([] if has_system else system), *prompt.messages]
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
    return [*system, {"role": "user", "content": user}]


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], template: str | None = None) -> list[int]:
    kwargs = {} if template is None else {"chat_template": template}
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    except ValueError as e:  # transformers: "Cannot use chat template functions because ... not set"
        raise RlbridgeError(
            f"data.chat_template: the tokenizer cannot apply a chat template ({e}); set data.chat_template to "
            "a Jinja chat template, or to false to encode the plain text (string prompts only)"
        ) from e
    except Exception as e:  # jinja2's TemplateError family, from a recipe's own template
        if template is None:
            raise
        raise RlbridgeError(f"data.chat_template: the template fails on {messages!r}: {e}") from e
    ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5 may return a BatchEncoding
    if len(ids) and isinstance(ids[0], list | tuple):
        ids = ids[0]
    return [int(t) for t in ids]


def encode_prompt(tokenizer: Any, prompt: Prompt, data_cfg: DataCfg) -> list[int]:
    """Token ids of one prompt: the chat template (the tokenizer's, or data.chat_template's) with the generation
    prompt, or the plain text with the system prompt and a blank line in front."""
    messages = render_messages(prompt, data_cfg)
    if data_cfg.chat_template is True:
        return _chat_ids(tokenizer, messages)
    if isinstance(data_cfg.chat_template, str):
        return _chat_ids(tokenizer, messages, data_cfg.chat_template)
    if prompt.messages is not None:
        raise RlbridgeError(
            "data.chat_template is false but the prompts are conversations (lists of messages); set "
            "data.chat_template: true (the tokenizer's) or to a Jinja chat template"
        )
    return [int(t) for t in tokenizer.encode("\n\n".join(m["content"] for m in messages))]


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], data_cfg: DataCfg, max_prompt_tokens: int
) -> tuple[list[list[int]], list[Prompt], int]:
    """Token ids of each prompt (`encode_prompt`), dropping those longer than max_prompt_tokens.

    Returns (ids of the kept prompts, the kept prompts, how many were dropped)."""
    ids_kept: list[list[int]] = []
    kept: list[Prompt] = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt, data_cfg)
        if len(ids) <= max_prompt_tokens:
            ids_kept.append(ids)
            kept.append(prompt)
    return ids_kept, kept, len(prompts) - len(kept)


class LazyEncoded:
    """The prompts of a Hugging Face datasets source with their token ids, each row read and encoded when first
    asked for (the most recent `cache_rows` kept). `prompts[i]` / `ids[i]` index like the lists of a file read
    whole; `usable(i)` says whether row i is a prompt within max_prompt_tokens, which the sampler asks before
    taking it. The first few unusable rows are logged with the reason."""

    def __init__(
        self,
        source: LazyPrompts,
        tokenizer: Any,
        data_cfg: DataCfg,
        max_prompt_tokens: int,
        *,
        cache_rows: int = 8192,
    ) -> None:
        self.source, self.tokenizer, self.data_cfg = source, tokenizer, data_cfg
        self.max_prompt_tokens, self.cache_rows = max_prompt_tokens, cache_rows
        self._cache: OrderedDict[int, tuple[Prompt, list[int]] | str] = OrderedDict()
        self.skipped = Skipped()
        """Rows left out so far (each counted once), with the reasons of the first few."""
        self._left_out: set[int] = set()
        self.prompts = _Indexed(len(source), lambda i: self._usable_entry(i)[0])
        self.ids = _Indexed(len(source), lambda i: self._usable_entry(i)[1])

    def __len__(self) -> int:
        return len(self.source)

    def entry(self, i: int) -> tuple[Prompt, list[int]] | str:
        """(prompt, ids) of row i, or why it is not used."""
        found = self._cache.get(i)
        if found is not None:
            self._cache.move_to_end(i)
            return found
        return self._add(i, self.source.get(i))

    def _add(self, i: int, got: Any) -> tuple[Prompt, list[int]] | str:
        if isinstance(got, Prompt):
            ids = encode_prompt(self.tokenizer, got, self.data_cfg)
            entry: tuple[Prompt, list[int]] | str = (
                (got, ids)
                if len(ids) <= self.max_prompt_tokens
                else f"{len(ids)} tokens, more than rollout.max_prompt_tokens {self.max_prompt_tokens}"
            )
        else:
            entry = got
        if isinstance(entry, str) and i not in self._left_out:
            self._left_out.add(i)
            self.skipped.add(f"row {i + 1}", entry)
            if self.skipped.count <= _MAX_EXAMPLES:
                log.warning("%s: row %d is left out: %s", self.source.description, i + 1, entry)
        self._cache[i] = entry
        if len(self._cache) > self.cache_rows:
            self._cache.popitem(last=False)
        return entry

    def usable_rows(self, indices: list[int]) -> list[bool]:
        """usable(i) of each index, the rows not read yet read together (the sampler's question per batch)."""
        missing = [i for i in dict.fromkeys(indices) if i not in self._cache]
        for i, got in zip(missing, self.source.get_many(missing), strict=True):
            self._add(i, got)
        return [self.usable(i) for i in indices]

    def usable(self, i: int) -> bool:
        return not isinstance(self.entry(i), str)

    def _usable_entry(self, i: int) -> tuple[Prompt, list[int]]:
        entry = self.entry(i)
        if isinstance(entry, str):
            raise IndexError(f"{self.source.description}: row {i + 1} is not usable: {entry}")
        return entry

    def first(self, k: int) -> tuple[list[Prompt], list[list[int]]]:
        """The first k usable prompts and their ids (evaluation's), scanning rows in order."""
        prompts: list[Prompt] = []
        ids: list[list[int]] = []
        for i in range(len(self)):
            if len(prompts) >= k:
                break
            entry = self.entry(i)
            if not isinstance(entry, str):
                prompts.append(entry[0])
                ids.append(entry[1])
        return prompts, ids


class _Indexed(Sequence[Any]):
    """A read-only sequence computed per index (LazyEncoded's prompts and ids)."""

    def __init__(self, size: int, at: Callable[[int], Any]) -> None:
        self._size, self._at = size, at

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._at(j) for j in range(*i.indices(self._size))]
        return self._at(int(i))


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

    A batch that runs past the end of an epoch takes the rest from the start of the next epoch's order. With
    `usable` (a source read lazily: LazyEncoded.usable_rows, asked about the rows of each batch together), a row
    it refuses is passed over as if absent: the position still moves, so the state stays the same four integers. Such a source (`fingerprint()`, millions of
    rows) is shuffled with numpy, 8 bytes per row.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        *,
        seed: int,
        shuffle: bool = True,
        usable: Callable[[list[int]], list[bool]] | None = None,
        fingerprint_of: Callable[[], str] | None = None,
    ) -> None:
        if not len(prompts):
            raise RlbridgeError("no prompts to sample from")
        self.prompts = prompts if usable is not None else list(prompts)
        self.seed, self.shuffle = seed, shuffle
        self.usable = usable
        self.epoch, self.index = 0, 0
        self._fingerprint = fingerprint_of() if fingerprint_of is not None else fingerprint(self.prompts)
        self._order_epoch = -1
        self._order: Sequence[int] | Any = []  # a list, or a numpy array for a lazy source

    def order(self, epoch: int) -> Sequence[int]:
        """The prompt indices of one epoch, in sampling order."""
        if epoch != self._order_epoch:
            n = len(self.prompts)
            if self.usable is not None:  # a lazy source: numpy, seeded from (seed, epoch) through sha256
                import numpy as np

                seed = int.from_bytes(hashlib.sha256(f"{self.seed}-{epoch}".encode()).digest()[:8], "little")
                self._order = np.random.default_rng(seed).permutation(n) if self.shuffle else np.arange(n)
            else:
                order = list(range(n))
                if (
                    self.shuffle
                ):  # a str seed is hashed with sha512: the same in every process and Python version
                    random.Random(f"{self.seed}-{epoch}").shuffle(order)
                self._order = order
            self._order_epoch = epoch
        return self._order

    def next_indices(self, batch_size: int) -> list[int]:
        """Positions in `prompts` of the next batch (to index parallel lists such as token ids)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        batch: list[int] = []
        passed = 0  # rows passed over since the last one taken
        while len(batch) < batch_size:
            order = self.order(self.epoch)
            take = [int(i) for i in order[self.index : self.index + batch_size - len(batch)]]
            self.index += len(take)
            if self.usable is not None:
                kept = [i for i, ok in zip(take, self.usable(take), strict=True) if ok]
                passed = 0 if kept else passed + len(take)
                if passed >= len(order):
                    raise RlbridgeError(
                        "no row of the training data is usable as a prompt (see the warnings)"
                    )
                take = kept
            batch.extend(take)
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
