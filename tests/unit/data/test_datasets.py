"""Datasets: jsonl/parquet loading with malformed rows counted, the arithmetic generator, rendering and
tokenization with a tiny chat tokenizer, and the resumable sampler."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rlbridge.data.arithmetic import arithmetic_rows
from rlbridge.data.datasets import (
    Prompt,
    PromptSampler,
    encode_prompts,
    load_dataset,
    read_dataset,
    render_messages,
)
from rlbridge.data.rewards import arithmetic_reward
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import ArithmeticCfg, DataCfg, DatasetCfg
from tests.fixtures.tiny_tokenizer import build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[3]
GSM8K_DIR = Path(os.environ.get("RLBRIDGE_GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k"))


def _data(path: str | Path, **kwargs: Any) -> tuple[DatasetCfg, DataCfg]:
    ds = DatasetCfg(path=str(path), **{k: v for k, v in kwargs.items() if k in DatasetCfg.model_fields})
    return ds, DataCfg(train=ds, **{k: v for k, v in kwargs.items() if k not in DatasetCfg.model_fields})


def _prompts(n: int) -> list[Prompt]:
    return [
        Prompt(text=f"q{i}", answer=str(i), row={"question": f"q{i}", "answer": str(i)}) for i in range(n)
    ]


# -------------------------------------------------------------------------------------------- jsonl
def test_jsonl_skips_and_counts_malformed_rows(tmp_path: Path) -> None:
    lines = [
        json.dumps({"question": "What is 1 + 1?", "answer": "2", "level": 1}),  # 1 ok
        "[1, 2]",  # 2 not an object
        json.dumps({"answer": "3"}),  # 3 missing prompt
        json.dumps({"question": 7, "answer": "3"}),  # 4 non-string prompt
        json.dumps({"question": "  ", "answer": "3"}),  # 5 empty prompt
        "{not json",  # 6 invalid JSON
        "",  # blank: ignored, not counted
        json.dumps({"question": "What is 2 + 2?", "answer": 4}),  # 8 ok, numeric answer
        json.dumps({"question": "q", "answer": None}),  # 9 bad answer
        json.dumps({"question": "q"}),  # 10 missing answer
    ]
    path = tmp_path / "train.jsonl"
    path.write_bytes(
        "\n".join(lines).encode() + b"\n" + b'{"question": "caf\xe9", "answer": "1"}\n'
    )  # 11 bad UTF-8
    ds, data = _data(path)
    prompts, skipped = read_dataset(ds, data, split="train", seed=0)
    assert [(p.text, p.answer) for p in prompts] == [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4")]
    assert prompts[0].row["level"] == 1 and prompts[1].sample["answer"] == "4"
    assert skipped.count == 8
    assert skipped.examples == [
        "line 2: not a JSON object but list",
        "line 3: missing 'question' (data.columns.prompt)",
        "line 4: 'question' is int, not a string or a list of messages",
        "line 5: empty 'question'",
        "line 6: invalid JSON (Expecting property name enclosed in double quotes at column 2)",
    ]
    assert "and 3 more" in str(skipped)
    assert [
        p.text for p in load_dataset(ds.model_copy(update={"limit": 1}), data, split="train", seed=0)
    ] == ["What is 1 + 1?"]


def test_jsonl_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps({"problem": "x", "answer": "1"}) + "\n")
    with pytest.raises(
        RlbridgeError,
        match=r"data\.val\.path: no usable row .*data\.columns\.prompt='question'.*line 1: missing 'question'",
    ):
        read_dataset(*_data(path), split="val", seed=0)
    assert read_dataset(*_data(path, prompt_key="problem"), split="val", seed=0)[0][0].text == "x"
    with pytest.raises(RlbridgeError, match=r"data\.train\.path: file not found"):
        load_dataset(*_data(tmp_path / "missing.jsonl"), split="train", seed=0)
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(RlbridgeError, match=r"data\.train\.path: unsupported file type '\.txt'"):
        load_dataset(*_data(tmp_path / "x.txt"), split="train", seed=0)
    with pytest.raises(RlbridgeError, match=r"data\.train\.path: file not found"):
        load_dataset(*_data(tmp_path / "missing.csv"), split="train", seed=0)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(RlbridgeError, match="the file has no rows"):
        load_dataset(*_data(tmp_path / "empty.jsonl"), split="train", seed=0)


def test_gsm8k_train_loads_whole() -> None:
    path = GSM8K_DIR / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K not found at {path} (set RLBRIDGE_GSM8K_DIR)")
    prompts, skipped = read_dataset(*_data(path), split="train", seed=0)
    assert len(prompts) == 7473 and skipped.count == 0 and "####" in prompts[0].answer


# ------------------------------------------------------------------------------------------ parquet
def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": f"What is {i} + 1?", "solution": str(i + 1), "tags": ["a", "b"]} for i in range(5)]
    rows[2]["prompt"] = ""
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    prompts, skipped = read_dataset(
        *_data(path, prompt_key="prompt", answer_key="solution"), split="train", seed=0
    )
    assert [p.row for p in prompts] == [r for i, r in enumerate(rows) if i != 2]
    assert prompts[0].sample["answer"] == "1" and skipped.examples == ["row 3: empty 'prompt'"]
    with pytest.raises(
        RlbridgeError,
        match=r"data\.columns\.answer: column 'answer' not in .*columns: prompt, solution, tags",
    ):
        read_dataset(*_data(path, prompt_key="prompt"), split="train", seed=0)


# --------------------------------------------------------------------------------------- arithmetic
def test_arithmetic_is_deterministic_and_disjoint() -> None:
    cfg = ArithmeticCfg(digits=2, ops=["+", "-", "*"], num_train=500, num_val=100)
    train = arithmetic_rows(cfg, split="train", seed=7)
    val = arithmetic_rows(cfg, split="val", seed=7)
    assert train == arithmetic_rows(cfg, split="train", seed=7) and train != arithmetic_rows(
        cfg, split="train", seed=8
    )
    texts = [r["question"] for r in train + val]
    assert len(train) == 500 and len(val) == 100 and len(set(texts)) == 600
    assert {r["op"] for r in train} == {"+", "-", "*"} and all(10 <= r["a"] <= 99 for r in train)
    for r in train + val:
        assert arithmetic_reward(r["question"], f"#### {r['answer']}", r) == 1.0
        assert r["question"] == f"What is {r['a']} {r['op']} {r['b']}?"


def test_arithmetic_small_space_and_capacity() -> None:
    cfg = ArithmeticCfg(digits=1, ops=["+"], num_train=90, num_val=10)  # exactly all 100 problems
    rows = arithmetic_rows(cfg, split="train", seed=0) + arithmetic_rows(cfg, split="val", seed=0)
    assert len({r["question"] for r in rows}) == 100
    with pytest.raises(
        RlbridgeError, match=r"data\.arithmetic\.num_train: 101 problems .* only 100 distinct"
    ):
        arithmetic_rows(cfg.model_copy(update={"num_val": 11}), split="train", seed=0)


def test_builtin_dataset_and_template() -> None:
    ds, data = _data(
        "builtin:arithmetic",
        limit=3,
        template="{prompt} Put the final answer after '####'.",
        arithmetic=ArithmeticCfg(num_train=10, num_val=5),
    )
    train = load_dataset(ds, data, split="train", seed=1)
    val = load_dataset(ds, data, split="val", seed=1)
    assert len(train) == 3 and len(val) == 3 and not {p.text for p in train} & {p.text for p in val}
    message = render_messages(train[0], data)
    assert message == [{"role": "user", "content": f"{train[0].text} Put the final answer after '####'."}]
    with pytest.raises(RlbridgeError, match=r"unknown builtin dataset 'builtin:gsm8k'"):
        load_dataset(*_data("builtin:gsm8k"), split="train", seed=0)


# ------------------------------------------------------------------------------------ rendering
def test_render_messages_uses_row_fields_and_reports_bad_templates() -> None:
    prompt = Prompt(
        text="What is 1 + 2?", answer="3", row={"question": "What is 1 + 2?", "answer": "3", "level": 2}
    )
    ds, data = _data("x.jsonl", template="[{level}] {prompt}", system_prompt="You are a helpful math tutor.")
    assert render_messages(prompt, data) == [
        {"role": "system", "content": "You are a helpful math tutor."},
        {"role": "user", "content": "[2] What is 1 + 2?"},
    ]
    with pytest.raises(
        RlbridgeError, match=r"data\.template names the field 'topic'.*answer, level, prompt, question"
    ):
        render_messages(prompt, data.model_copy(update={"template": "{topic}: {prompt}"}))
    with pytest.raises(RlbridgeError, match=r"data\.template .* is not a valid format string"):
        render_messages(prompt, data.model_copy(update={"template": "{prompt"}))


def test_encode_prompts_chat_template_and_length_filter() -> None:
    tok = build_tiny_tokenizer()
    texts = ("What is 47 + 38?", "What is 1 + 2 + 3 + 4 + 5?", "What is 2?")
    prompts = [Prompt(text=t, answer="0", row={}) for t in texts]
    ds, data = _data("x.jsonl", template="{prompt} Put the final answer after ####")
    ids, kept, num_filtered = encode_prompts(tok, prompts, data, max_prompt_tokens=18)
    assert tok.convert_ids_to_tokens(ids[0]) == [
        "<s>",
        "<|im_start|>",
        "user",
        "What",
        "is",
        "47",
        "+",
        "38",
        "?",
        "Put",
        "the",
        "final",
        "answer",
        "after",
        "####",
        "<|im_end|>",
        "<|im_start|>",
        "assistant",
    ]
    # 18, 24 and 16 tokens: the middle one is filtered out and counted
    assert [p.text for p in kept] == [texts[0], texts[2]] and num_filtered == 1
    assert [len(i) for i in ids] == [18, 16] and all(type(t) is int for t in ids[0])
    assert encode_prompts(tok, prompts, data, max_prompt_tokens=14)[1:] == ([], 3)


def test_encode_prompts_plain_and_missing_chat_template() -> None:
    tok = build_tiny_tokenizer(chat_template=False)
    prompt = Prompt(text="What is 47 + 38?", answer="85", row={})
    ds, data = _data("x.jsonl", chat_template=False, system_prompt="You are a helpful math tutor.")
    ids, kept, num_filtered = encode_prompts(tok, [prompt], data, max_prompt_tokens=100)
    assert tok.convert_ids_to_tokens(ids[0]) == [
        "You",
        "are",
        "a",
        "helpful",
        "math",
        "tutor",
        ".",
        "What",
        "is",
        "47",
        "+",
        "38",
        "?",
    ]
    with pytest.raises(RlbridgeError, match=r"data\.chat_template: .*or to false"):
        encode_prompts(tok, [prompt], data.model_copy(update={"chat_template": True}), max_prompt_tokens=100)


# ------------------------------------------------------------------------------------------ sampler
def _batches(sampler: PromptSampler, sizes: list[int]) -> list[list[str]]:
    return [[p.text for p in sampler.next_batch(n)] for n in sizes]


def test_sampler_epochs_are_permutations_and_cross_boundaries() -> None:
    sampler = PromptSampler(_prompts(10), seed=3)
    first, second = sampler.order(0)[:], sampler.order(1)[:]
    assert sorted(first) == list(range(10)) and first != second
    batches = _batches(sampler, [4, 4, 4])
    assert [t for b in batches for t in b] == [f"q{i}" for i in first + second[:2]]
    assert sampler.state() | {"fingerprint": None} == {
        "seed": 3,
        "shuffle": True,
        "epoch": 1,
        "index": 2,
        "size": 10,
        "fingerprint": None,
    }
    assert _batches(PromptSampler(_prompts(10), seed=3, shuffle=False), [25])[0][20:] == [
        f"q{i}" for i in range(5)
    ]
    assert PromptSampler(_prompts(10), seed=3).order(0) == first  # depends on (seed, epoch) only
    assert PromptSampler(_prompts(10), seed=3).next_indices(12) == first + second[:2]


@pytest.mark.parametrize("consumed", [0, 4, 10, 12, 20, 23], ids=lambda n: f"after{n}")
def test_sampler_resume_matches_uninterrupted(consumed: int) -> None:
    """Resume after `consumed` prompts (10 per epoch: 10 and 20 are exact epoch boundaries)."""
    reference = PromptSampler(_prompts(10), seed=11)
    expected = _batches(reference, [1] * consumed + [3, 7, 4, 10, 5])[consumed:]
    interrupted = PromptSampler(_prompts(10), seed=11)
    _batches(interrupted, [1] * consumed)
    state = json.loads(json.dumps(interrupted.state()))
    resumed = PromptSampler(_prompts(10), seed=11)
    resumed.load_state(state)
    assert _batches(resumed, [3, 7, 4, 10, 5]) == expected
    assert (state["epoch"], state["index"]) == divmod(consumed, 10)


def test_sampler_refuses_other_data() -> None:
    state = PromptSampler(_prompts(10), seed=1).state()
    with pytest.raises(RlbridgeError, match="for 10 prompts but the dataset now has 9"):
        PromptSampler(_prompts(9), seed=1).load_state(state)
    changed = _prompts(10)
    changed[3] = Prompt(text="other", answer="3", row={})
    with pytest.raises(RlbridgeError, match="different prompts"):
        PromptSampler(changed, seed=1).load_state(state)
    with pytest.raises(RlbridgeError, match="invalid data position"):
        PromptSampler(_prompts(10), seed=1).load_state({**state, "index": 11})
    with pytest.raises(RlbridgeError, match="no prompts"):
        PromptSampler([], seed=1)
