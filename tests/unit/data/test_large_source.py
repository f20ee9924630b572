"""A training file of many rows stays on disk: opened as a run opens data.train (`open_prompts` under loader auto,
`LazyEncoded`, `PromptSampler` with its fingerprint), a 200,000-row .jsonl grows the process's memory by a small
fraction of what its rows would take as Python objects, and a resume near the end of the epoch lands on the rows
an uninterrupted walk reaches (bench/data_rows.py measures the same path at ten million rows)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.data_rows import WORDS, row
from rlbridge.data.datasets import (
    Columns,
    LazyEncoded,
    PromptSampler,
    encode_prompt,
    open_prompts,
    to_prompt,
    uses_datasets,
)
from rlbridge.data.datasets import load as load_module
from rlbridge.errors import RecipeError
from rlbridge.recipe.load import load_recipe
from rlbridge.recipe.schema import DataCfg, DatasetCfg
from tests.fixtures.tiny_tokenizer import build_tiny_tokenizer

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")

ROWS = 200_000
BATCH = 64


def held_bytes(rows: list[dict[str, str]], data: DataCfg, tokenizer: object) -> int:
    """What loader memory holds for `rows` (parsed rows, their Prompts and token ids), by tracemalloc."""
    import tracemalloc

    tracemalloc.start()
    try:
        parsed = [json.loads(json.dumps(r)) for r in rows]
        columns = Columns.of(data.train, data, "train")
        held = [(p, encode_prompt(tokenizer, p, data)) for p in (to_prompt(r, columns) for r in parsed)]
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(held) == len(rows)
    return size


def memory_kib() -> dict[str, int]:
    """VmRSS and RssAnon of this process, KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon")}


@pytest.fixture(autouse=True)
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def write_rows(path: Path, num_rows: int) -> Path:
    with path.open("w") as f:
        for start in range(0, num_rows, 50_000):
            f.write("".join(json.dumps(row(i)) + "\n" for i in range(start, min(start + 50_000, num_rows))))
    return path


def open_train(path: Path) -> tuple[LazyEncoded, Callable[[], PromptSampler]]:
    """data.train as Session._start opens it (loader auto): the source, and its sampler as built there."""
    data = DataCfg.model_validate({"train": {"path": str(path)}, "batch_size": BATCH})
    source = open_prompts(data.train, data, split="train", seed=0)  # converts to Arrow, then memory-maps it
    assert not isinstance(source, list), "loader auto read a file over WHOLE_FILE_BYTES whole"
    lazy = LazyEncoded(source, build_tiny_tokenizer(extra_words=WORDS), data, 512)

    def sampler() -> PromptSampler:
        return PromptSampler(
            lazy.prompts, seed=3, usable=lazy.usable_rows, fingerprint_of=lazy.source.fingerprint
        )

    return lazy, sampler


def test_a_large_jsonl_is_memory_mapped_and_resumes_on_the_same_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # loader auto sends a file over WHOLE_FILE_BYTES through datasets; these (10 and 35 MB) are made to count
    monkeypatch.setattr(load_module, "WHOLE_FILE_BYTES", 1024**2)
    # A first, small file (over datasets' 10 MB json chunk) pays what does not grow with rows: imports, the
    # builder's parse of a file's first chunk into Python objects (to detect mixed types), allocator pools.
    warm, warm_sampler = open_train(write_rows(tmp_path / "warm.jsonl", 60_000))
    warm_sampler().next_indices(BATCH)
    path = write_rows(tmp_path / "train.jsonl", ROWS)
    data = DataCfg.model_validate({"train": {"path": str(path)}, "batch_size": BATCH})
    sample = [row(i) for i in range(0, ROWS, ROWS // 2000)]
    in_python = held_bytes(sample, data, warm.tokenizer) * ROWS // len(sample)

    before = memory_kib()
    lazy, sampler = open_train(path)
    walk = sampler()
    batches = [walk.next_indices(BATCH) for _ in range(20)]
    grew = {k: (v - before[k]) * 1024 for k, v in memory_kib().items()}
    # Bounds: VmRSS growth < 1/2 and RssAnon growth < 1/3 of what loader memory would hold for these rows (read
    # whole, the same open grows by ~1.8 kB per row, all of it). Held ~1.79 kB per row (357 MB); the file alone
    # grows VmRSS by +52-56 MB (it counts the pages of the memory-mapped Arrow file that were read) and RssAnon by
    # +21-24 MB, but after the rest of the suite has run in the process the allocator's state adds to both
    # (+85 MB and +53 MB seen). The growth is the same at 400k and 800k rows: it does not follow the rows.
    assert in_python > 200e6, in_python
    assert grew["VmRSS"] < in_python / 2 and grew["RssAnon"] < in_python / 3, (grew, in_python)
    assert (
        len(lazy) == ROWS and [lazy.prompts[i].text.endswith(f"#{i}") for i in batches[0]] == [True] * BATCH
    )

    resumed = sampler()  # a resume after batch 8: the uninterrupted walk's batches 8..19
    middle = sampler()
    for _ in range(8):
        middle.next_indices(BATCH)
    resumed.load_state(json.loads(json.dumps(middle.state())))
    assert [resumed.next_indices(BATCH) for _ in range(12)] == batches[8:]

    # Near the end of the epoch: an uninterrupted walk that reads no row (all usable), to 100 rows before the
    # end, then three batches across the epoch boundary; the resumed sampler reads its rows from disk.
    free_walk = PromptSampler(
        lazy.prompts, seed=3, usable=lambda ix: [True] * len(ix), fingerprint_of=lazy.source.fingerprint
    )
    while free_walk.index + 8192 < ROWS - 100:
        free_walk.next_indices(8192)
    free_walk.next_indices(ROWS - 100 - free_walk.index)
    state = json.loads(json.dumps(free_walk.state()))
    assert (state["epoch"], state["index"]) == (0, ROWS - 100)
    want = [free_walk.next_indices(BATCH) for _ in range(3)]
    near_end = sampler()
    near_end.load_state(state)
    got = [near_end.next_indices(BATCH) for _ in range(3)]
    assert got == want and near_end.epoch == 1
    assert all(lazy.prompts[i].text == row(i)["question"] for b in got for i in b)


def test_loader_auto_reads_a_file_whole_up_to_whole_file_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small, large = write_rows(tmp_path / "small.jsonl", 10), write_rows(tmp_path / "large.jsonl", 2000)
    monkeypatch.setattr(load_module, "WHOLE_FILE_BYTES", small.stat().st_size)
    cfg = lambda path, loader="auto": DatasetCfg(path=str(path), loader=loader)  # noqa: E731
    assert not uses_datasets(cfg(small)) and uses_datasets(cfg(large))
    assert not uses_datasets(cfg(large, "memory")) and uses_datasets(cfg(small, "datasets"))
    assert not uses_datasets(cfg(tmp_path / "missing.jsonl"))  # read whole: its error names the missing file
    data = DataCfg.model_validate({"train": {"path": str(large), "loader": "memory"}})
    prompts = open_prompts(data.train, data, split="train", seed=0)
    assert isinstance(prompts, list) and len(prompts) == 2000

    sets = ["data.train.path=openai/gsm8k", "data.train.loader=memory"]  # not a .jsonl / .parquet file
    with pytest.raises(RecipeError) as err:
        load_recipe("recipes/quickstart.yaml", overrides=sets)
    assert "data.train" in str(err.value) and "loader memory reads a .jsonl or .parquet file" in str(
        err.value
    )
