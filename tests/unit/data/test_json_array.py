"""A .json file holding one JSON array: read one element at a time (rlbridge/data/json_array.py), checked against
`json.load` of the whole file at every chunk boundary; malformed files named by line and column; through a run's
data path the array becomes JSON Lines in datasets' cache, the process's memory grows by a fraction of the file,
the rows are datasets' own rows of the array, and a resume lands on the rows an uninterrupted walk reaches."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.data_rows import row
from rlbridge.data import json_array
from rlbridge.data.datasets import PromptSampler, open_prompts, preview
from rlbridge.data.json_array import array_elements, is_json_array
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import DataCfg

datasets = pytest.importorskip("datasets")

TRICKY: list[dict[str, Any]] = [
    {"question": 'a "quoted" word, a \\ backslash', "answer": 1},
    {"question": "line one\nline two\ttab \u00e9\u4e2d\U0001f600", "answer": -2.5e-3, "x": None},
    {"question": "nested", "answer": "3", "meta": {"tags": ["a", {"b": [1, 2, {"c": True}]}], "f": False}},
    {"question": "]},[{ inside a string", "answer": 12345678901234},
    {"question": "long " * 200, "answer": 0.1},
]


@pytest.fixture(autouse=True)
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, json_array.CHUNK_CHARS])
@pytest.mark.parametrize("layout", ["indented", "compact", "bom"])
def test_elements_are_json_load_at_every_chunk_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, layout: str
) -> None:
    monkeypatch.setattr(json_array, "CHUNK_CHARS", chunk)
    text = json.dumps(TRICKY, indent=2 if layout == "indented" else None, ensure_ascii=False)
    path = tmp_path / "rows.json"
    path.write_bytes((b"\xef\xbb\xbf" if layout == "bom" else b"") + f"\n {text}\n".encode())
    assert is_json_array(path)
    elements = list(array_elements(path, "data.train"))
    assert [e.value for e in elements] == json.loads(text) == TRICKY
    assert all("\n" not in e.text and json.loads(e.text) == e.value for e in elements)
    # the line each element starts on: in the indented layout, the lines that are "  {" (text starts on line 2)
    starts = [n for n, line in enumerate(f"\n {text}\n".splitlines(), 1) if line == "  {"]
    assert [e.line for e in elements] == (starts if layout == "indented" else [2] * len(TRICKY))
    empty = tmp_path / "empty.json"
    empty.write_text(" [ ] ")
    assert list(array_elements(empty, "data.train")) == []


BROKEN = [
    ("a missing comma", '[\n  {"q": 1}\n  {"q": 2}\n]', "expected ',' or ']' after element 0, found '{' at line 3"),
    ("a trailing comma", '[\n  {"q": 1},\n]', "element 1 starts with ']'"),
    ("cut short", '[\n  {"q": 1},\n  {"q": "tw', "Unterminated string starting at (element 1) at line 3 column 9"),
    ("a string, not an object", '[{"q": 1}, "two"]', "element 1 starts with '\"', not '{' (an object) at line 1"),
    ("text after the array", '[{"q": 1}]\n[]', "text after the closing ']' at line 2 column 1"),
    ("a bad value", '[\n{"q": tru}]', "Expecting value (element 0) at line 2 column 7"),
]  # fmt: skip


@pytest.mark.parametrize(("desc", "text", "said"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_malformed_array_is_named_by_line_and_column(
    tmp_path: Path, desc: str, text: str, said: str
) -> None:
    path = tmp_path / "rows.json"
    path.write_text(text)
    with pytest.raises(RlbridgeError) as e:
        list(array_elements(path, "data.train"))
    assert str(e.value).startswith(f"data.train.path: {path} is not a JSON array of row objects: "), str(
        e.value
    )
    assert said in str(e.value) and "python -m json.tool" in str(e.value), str(e.value)


def write_array(path: Path, num_rows: int) -> Path:
    with path.open("w") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(row(i)) for i in range(num_rows)))
        f.write("\n]\n")
    return path


def rss_anon() -> int:
    """This process's anonymous resident memory, bytes (what memory-mapping does not explain)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["RssAnon"].split()[0]) * 1024


def peak_growth(call: Callable[[], Any]) -> tuple[Any, int]:
    """call()'s result and the peak of rss_anon() over its start, sampled every 5 ms by a thread."""
    start, peak, done = rss_anon(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.005)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        result = call()
    finally:
        done.set()
        watcher.join()
    return result, max(peak[0], rss_anon()) - start


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_a_json_array_is_converted_in_pieces_and_resumes_on_the_same_rows(tmp_path: Path) -> None:
    num_rows, batch = 300_000, 32
    data = lambda path: DataCfg.model_validate({"train": {"path": str(path)}, "batch_size": batch})  # noqa: E731
    small = write_array(tmp_path / "small.json", 50)
    rows = [open_prompts(data(small).train, data(small), split="train", seed=0).get(i).row for i in range(50)]
    assert (
        rows == datasets.load_dataset("json", data_files=str(small), split="train").to_list()
    )  # its own reading
    # Paid before measuring, as they do not grow with the rows: imports, and the json builder's parse of the first
    # 10 MB chunk of JSON Lines into Python objects (to detect mixed types), whose allocator pools stay.
    warm = write_array(tmp_path / "warm.json", 60_000)
    open_prompts(data(warm).train, data(warm), split="train", seed=0)

    path = write_array(tmp_path / "train.json", num_rows)  # 55 MB
    lazy, ours = peak_growth(lambda: open_prompts(data(path).train, data(path), split="train", seed=0))
    whole = write_array(tmp_path / "whole.json", num_rows)
    _, theirs = peak_growth(lambda: datasets.load_dataset("json", data_files=str(whole), split="train"))
    # datasets' json builder reads an array whole (its bytes, every row as a Python object, the rows again as JSON
    # Lines): measured here +357-372 MB of anonymous memory at the peak (and +2.5 GB of RSS for a 348 MB file of 2M
    # rows); converted element by element +47-51 MB, what does not grow with the rows (the builder's 10 MB chunks).
    assert ours < theirs / 4, (ours, theirs)
    assert not isinstance(lazy, list) and len(lazy) == num_rows
    assert [lazy.get(i).text for i in (0, 277_777, num_rows - 1)] == [
        row(i)["question"] for i in (0, 277_777, num_rows - 1)
    ]

    sampler = lambda source: PromptSampler(  # noqa: E731
        source, seed=3, usable=lambda ix: [True] * len(ix), fingerprint_of=source.fingerprint
    )
    walk = sampler(lazy)
    batches = [walk.next_indices(batch) for _ in range(6)]
    middle = sampler(lazy)
    for _ in range(2):
        middle.next_indices(batch)
    reopened = open_prompts(data(path).train, data(path), split="train", seed=0)  # the cached conversion
    resumed = sampler(reopened)
    resumed.load_state(json.loads(json.dumps(middle.state())))  # refused on other rows (the fingerprint)
    got = [resumed.next_indices(batch) for _ in range(4)]
    assert got == batches[2:]
    assert all(reopened.get(i).text == row(i)["question"] for b in got for i in b)


def test_validation_reads_the_first_rows_of_an_array_only(tmp_path: Path) -> None:
    """A file broken near its end: validate-recipe's preview reads the first rows and passes; a run's conversion
    reads it all and names the line."""
    path = write_array(tmp_path / "train.json", 5000)
    text = path.read_text()
    broken = text[: text.rindex("}")] + "\n"  # the last row's closing brace and the ']' gone
    path.write_text(broken)
    cfg = DataCfg.model_validate({"train": {"path": str(path)}})
    rows, names = preview(cfg.train, cfg, split="train", num_rows=100)
    assert [r for _, r, _ in rows] == [row(i) for i in range(100)] and rows[1][0] == "row 2 (line 3)"
    with pytest.raises(
        RlbridgeError, match=r"data\.train\.path: .*delimiter \(element 4999\) at line 5002 column 1"
    ):
        open_prompts(cfg.train, cfg, split="train", seed=0)
