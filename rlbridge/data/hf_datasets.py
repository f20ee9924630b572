"""Rows through Hugging Face `datasets`: Hub names, local files and folders, memory-mapped.

`datasets` does the reading and the caching (its Arrow cache, `HF_HOME` / `HF_DATASETS_CACHE`, the Hub's
offline mode and tokens); rlbridge asks it for one split and reads rows by index. A loaded split is Arrow on
disk, memory-mapped: a file of ten million rows costs its page cache, not the process's memory, and row `i` is
read when the sampler asks for it (`LazyPrompts`). `preview` reads only the first rows (streaming for local
files, so validation does not convert a large file first).

This is the one module that imports `datasets`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlbridge.data.json_array import is_json_array, write_json_lines
from rlbridge.errors import DataError, RlbridgeError
from rlbridge.recipe.schema import DatasetCfg

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
"""datasets' packaged builder for each local file suffix."""
FINGERPRINT_ROWS = 1024
"""Rows hashed (evenly spaced) into a lazy source's fingerprint, besides its length."""
PARQUET_BATCH_ROWS = 10_000
"""Rows per batch when datasets converts a parquet file into its Arrow cache: its default is a whole row group
(up to a million rows in a file pyarrow or pandas wrote), decoded at once."""


def _datasets(key: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise RlbridgeError(
            f"{key}: reading this source needs Hugging Face datasets: pip install datasets"
        ) from None
    datasets.disable_progress_bars()  # rlbridge's own lines say what is read
    datasets.logging.set_verbosity_error()  # "Using the latest cached version ..." on every offline load
    return datasets


_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def is_hub_name(path: str) -> bool:
    """`org/name` (or a bare `name`) as the Hub spells dataset ids, not a file name with a data suffix."""
    return bool(_HUB_NAME.match(path)) and ".." not in path and Path(path).suffix.lower() not in BUILDERS


def _hub_offline(key: str) -> bool:
    return bool(_datasets(key).config.HF_HUB_OFFLINE)


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def default_split(which: str, names: list[str]) -> str | None:
    """The split a recipe means without data.<which>.split: train, or for val validation then test; a source
    with one split: that one."""
    if len(names) == 1:
        return names[0]
    wanted = ("train",) if which == "train" else ("validation", "test", "valid", "val")
    return next((n for n in wanted if n in names), None)


def _pick(found: Any, cfg: DatasetCfg, which: str, key: str) -> Any:
    """One split of a DatasetDict (or the Dataset itself, which is one split)."""
    if not hasattr(found, "keys"):
        if cfg.split not in (None, "train"):
            raise DataError(
                f"{key}.split",
                f"{cfg.path} holds one split (a Dataset saved with save_to_disk), not a DatasetDict of splits",
                f"remove {key}.split, or point {key}.path at a source with a split {cfg.split!r}",
                value=cfg.split,
            )
        return found
    names = list(found.keys())
    split = cfg.split or default_split(which, names)
    if split not in names:
        named = f"split {split!r}" if cfg.split else f"default split (for data.{which}: {_defaults(which)})"
        raise DataError(
            f"{key}.split",
            f"{cfg.path} has no {named}; its splits: {', '.join(names)}",
            f"set {key}.split to one of: {', '.join(names)}",
            value=cfg.split,
        )
    return found[split]


def _defaults(which: str) -> str:
    return "train" if which == "train" else "validation, test, valid or val"


def check_single_file(cfg: DatasetCfg, key: str) -> None:
    """A single file is one split (train) of one configuration: a data.<split>.split or .config naming another is
    an error, never ignored."""
    if cfg.split not in (None, "train"):
        raise DataError(
            f"{key}.split",
            f"a single file has one split ({cfg.path})",
            f"remove {key}.split, or point {key}.path at the file of split {cfg.split!r}",
            value=cfg.split,
        )
    if cfg.config is not None:
        raise DataError(
            f"{key}.config",
            f"a single file has no configurations ({cfg.path})",
            f"remove {key}.config, or point {key}.path at the file of configuration {cfg.config!r}",
            value=cfg.config,
        )


def _single_file(path: Path, cfg: DatasetCfg, key: str) -> str:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise RlbridgeError(
            f"{key}.path: unsupported file type {path.suffix or '(none)'!r} ({cfg.path}); use .jsonl, .json, "
            ".csv, .parquet or .arrow, a folder, or a Hub dataset name"
        )
    check_single_file(cfg, key)
    return builder


def _saved(cfg: DatasetCfg, key: str) -> None:
    if cfg.config is not None:
        raise DataError(
            f"{key}.config",
            f"{cfg.path} is a folder written by save_to_disk, which has no configurations",
            f"remove {key}.config, or point {key}.path at the folder of configuration {cfg.config!r}",
            value=cfg.config,
        )


def open_split(cfg: DatasetCfg, which: str) -> Any:
    """The split as a memory-mapped `datasets.Dataset` (at most cfg.limit rows)."""
    key = f"data.{which}"
    path = Path(cfg.path).expanduser()
    if not path.exists() and not is_hub_name(cfg.path):
        raise RlbridgeError(
            f"{key}.path: file not found: {cfg.path} (relative paths are from the current directory; a Hub "
            "dataset is named org/name)"
        )
    builder = _single_file(path, cfg, key) if path.is_file() else None  # an unsupported file: said first
    ds_lib = _datasets(key)
    try:
        if builder is not None:
            batch = {"batch_size": PARQUET_BATCH_ROWS} if builder == "parquet" else {}
            data_file = json_lines_of(path, key) if builder == "json" and is_json_array(path) else path
            found = ds_lib.load_dataset(builder, data_files=str(data_file), split="train", **batch)
        elif path.is_dir() and is_saved_dataset(path):
            _saved(cfg, key)
            found = _pick(ds_lib.load_from_disk(str(path)), cfg, which, key)
        elif path.is_dir():
            found = _pick(ds_lib.load_dataset(str(path), cfg.config), cfg, which, key)
        else:
            found = _pick(ds_lib.load_dataset(cfg.path, cfg.config), cfg, which, key)
    except RlbridgeError:
        raise
    except (
        Exception
    ) as e:  # datasets raises ValueError, FileNotFoundError, ConnectionError, DatasetGenerationError
        raise _load_error(cfg, key, path, e) from None
    if cfg.limit is not None and cfg.limit < found.num_rows:
        found = found.select(range(cfg.limit))
    return found


_CONFIGS = (
    re.compile(
        r"[Aa]vailable(?: configs)?(?: in the cache)?: \[([^\]]*)\]"
    ),  # "BuilderConfig 'x' not found. ..."
    re.compile(r"configurations in the cache: (.*?) Please"),  # offline, none named, several cached
)


def _config_error(cfg: DatasetCfg, key: str, text: str) -> DataError | None:
    """datasets' answer to a configuration the source lacks (or several and none named), as the key to change."""
    found = next((m for m in (p.search(text) for p in _CONFIGS) if m), None)
    if found is None:
        return None
    names = [n.strip(" '\"") for n in found.group(1).split(",") if n.strip(" '\"")]
    if not names:  # nothing cached: the offline message below says what to do
        return None
    if cfg.config is None:
        return DataError(
            f"{key}.config",
            f"{cfg.path} has several configurations: {', '.join(names)}",
            f"set {key}.config to one of them",
        )
    if names == ["default"]:  # a folder of data files: its one configuration, taken without a name
        return DataError(
            f"{key}.config",
            f"{cfg.path} has no configuration {cfg.config!r} (a folder of data files has one, unnamed)",
            f"remove {key}.config",
            value=cfg.config,
        )
    return DataError(
        f"{key}.config",
        f"{cfg.path} has no configuration {cfg.config!r}; its configurations: {', '.join(names)}",
        f"set {key}.config to one of them",
        value=cfg.config,
    )


JSON_LINES_DIR = "rlbridge-json-lines"
"""Folder of datasets' cache holding JSON array files converted to JSON Lines (`json_lines_of`)."""


def json_lines_of(path: Path, key: str) -> Path:
    """The JSON array in `path` as a JSON Lines file in datasets' cache, written once per version of the file (its
    size and modification time) by reading one element at a time: datasets reads a JSON array whole into Python
    objects, JSON Lines in chunks. An older version's conversion of the same file is removed."""
    folder = Path(_datasets(key).config.HF_DATASETS_CACHE) / JSON_LINES_DIR
    folder /= hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    stat = path.stat()
    target = folder / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}.jsonl"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        with partial.open("w", encoding="utf-8") as out:
            if not write_json_lines(path, out, key):
                raise RlbridgeError(f"{key}.path: {path} is an empty JSON array (no rows)")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    for old in folder.glob("*.jsonl"):
        if old != target:
            old.unlink(missing_ok=True)
    return target


def _load_error(cfg: DatasetCfg, key: str, path: Path, e: Exception) -> RlbridgeError:
    text = " ".join(str(e).split())[:600]
    config_error = _config_error(cfg, key, text)
    if config_error is not None:
        return config_error
    if path.exists():
        return RlbridgeError(f"{key}.path: Hugging Face datasets cannot read {cfg.path}: {text}")
    name = f"{cfg.path}" + (f" (config {cfg.config})" if cfg.config else "")
    if isinstance(e, ConnectionError) or "offline" in text.lower():
        cfg_arg = f" {cfg.config}" if cfg.config else ""
        return RlbridgeError(
            f"{key}.path: {name} is not a local path and not in the Hugging Face datasets cache, and the Hub "
            f'cannot be reached (offline). Load it once online, e.g. python -c "import datasets; '
            f"datasets.load_dataset('{cfg.path}'{f', {cfg.config!r}' if cfg.config else ''})\", or download "
            f"its files (hf download {cfg.path}{cfg_arg} --repo-type dataset) and point {key}.path at the folder"
        )
    return RlbridgeError(f"{key}.path: cannot load {name} with Hugging Face datasets: {text}")


def preview(cfg: DatasetCfg, which: str, num_rows: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The first rows of the source and its column names, reading as little as possible: local files, data folders
    and (online) Hub datasets stream (nothing converted or downloaded whole); a save_to_disk folder or (offline) a
    Hub dataset of the local cache opens memory-mapped."""
    key = f"data.{which}"
    path = Path(cfg.path).expanduser()
    online_hub = not path.exists() and is_hub_name(cfg.path) and not _hub_offline(key)
    if (path.exists() and not is_saved_dataset(path)) or online_hub:
        builder = _single_file(path, cfg, key) if path.is_file() else None  # an unsupported file: said first
        ds_lib = _datasets(key)
        try:
            if builder is not None:
                stream = ds_lib.load_dataset(builder, data_files=str(path), split="train", streaming=True)
            else:  # a data folder, or a Hub dataset while online: its first shard, not the whole download
                source = str(path) if path.exists() else cfg.path
                stream = _pick(ds_lib.load_dataset(source, cfg.config, streaming=True), cfg, which, key)
            rows = [dict(r) for _, r in zip(range(num_rows), iter(stream), strict=False)]
        except RlbridgeError:
            raise
        except Exception as e:
            raise _load_error(cfg, key, path, e) from None
        columns = list(stream.column_names or (rows[0].keys() if rows else []))
        return rows, columns
    found = open_split(cfg, which)
    return [found[i] for i in range(min(num_rows, found.num_rows))], list(found.column_names)


class LazyPrompts:
    """A split's rows as prompts, read by index from the memory-mapped split: `get(i)` is a Prompt, or the
    reason the row cannot be one (the sampler passes over such rows). `convert` is datasets.to_prompt with the
    recipe's columns bound."""

    def __init__(self, split: Any, convert: Callable[[Any], Any], description: str) -> None:
        self.split = split
        self.convert = convert
        self.description = description

    def __len__(self) -> int:
        return int(self.split.num_rows)

    def get(self, i: int) -> Any:
        return self.convert(self.split[int(i)])

    def get_many(self, indices: list[int]) -> list[Any]:
        """`get` of several rows, read from Arrow in one call (about 5x faster per row than one by one)."""
        if not indices:
            return []
        columns = self.split[[int(i) for i in indices]]
        names = list(columns)
        return [
            self.convert(dict(zip(names, values, strict=True)))
            for values in zip(*columns.values(), strict=True)
        ]

    def rows(self) -> Iterator[tuple[str, Any]]:
        """(where, row) for every row, in order (for a full read: validation previews, small eval splits)."""
        for i, row in enumerate(self.split):
            yield f"row {i + 1}", row

    def fingerprint(self) -> str:
        """The length and FINGERPRINT_ROWS evenly spaced rows, hashed: a resume on other data is refused without
        reading ten million rows."""
        n = len(self)
        digest = hashlib.sha256(f"{n};".encode())
        step = max(n // FINGERPRINT_ROWS, 1)
        for i in range(0, n, step):
            digest.update(json.dumps(self.split[i], sort_keys=True, default=str).encode() + b"\0")
        return digest.hexdigest()[:16]
