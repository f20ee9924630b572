"""Data through Hugging Face datasets, offline: local files and folders, a Hub dataset from the local datasets
cache (built in the test as an online load leaves it), column mapping, conversational prompts with the tokenizer's
or the recipe's chat template, lazy reading and the exact resume position of the sampler on such a source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rlbridge.data.datasets import (
    LazyEncoded,
    Prompt,
    PromptSampler,
    encode_prompt,
    open_prompts,
    read_dataset,
    render_messages,
)
from rlbridge.errors import DataError, RlbridgeError
from rlbridge.recipe.schema import DataCfg, DatasetCfg
from tests.fixtures.tiny_tokenizer import build_tiny_tokenizer

datasets = pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """datasets' cache under tmp_path, the Hub offline (both libraries read the environment once, at import)."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def _rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"problem": f"What is {i} + 1?", "solution": str(i + 1), "level": i % 3} for i in range(start, n)]


def _data(path: str | Path, **kwargs: Any) -> DataCfg:
    ds = {k: kwargs.pop(k) for k in list(kwargs) if k in DatasetCfg.model_fields}
    return DataCfg.model_validate(
        {"train": {"path": str(path), **ds}, "columns": {"prompt": "problem", "answer": "solution"}, **kwargs}
    )


def _texts(cfg: DataCfg, which: str = "train") -> list[str]:
    ds = cfg.train if which == "train" else cfg.val
    assert ds is not None
    prompts, _ = read_dataset(ds, cfg, split=which, seed=0)  # type: ignore[arg-type]
    return [p.text for p in prompts]


def test_local_files_and_folders(tmp_path: Path) -> None:
    rows = _rows(4)
    want = [r["problem"] for r in rows]
    (tmp_path / "a.json").write_text(json.dumps(rows))  # a JSON array
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    datasets.Dataset.from_list(rows).to_csv(tmp_path / "c.csv")
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    for name in ("a.json", "c.csv"):
        assert _texts(_data(tmp_path / name)) == want
    for name in ("b.jsonl", "d.parquet"):  # loader datasets: the same rows as the row-by-row reader
        assert _texts(_data(tmp_path / name, loader="datasets")) == want == _texts(_data(tmp_path / name))
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(_rows(6, 4))}
    ).save_to_disk(saved)
    cfg = DataCfg.model_validate(
        {
            "train": {"path": str(saved)},
            "val": {"path": str(saved)},  # default split of val: validation, else test
            "columns": {"prompt": "problem", "answer": "solution"},
        }
    )
    assert _texts(cfg) == want and _texts(cfg, "val") == ["What is 4 + 1?", "What is 5 + 1?"]
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(tmp_path / "d.parquet", folder / "train.parquet")
    assert _texts(_data(folder)) == want
    prompts, _ = read_dataset(_data(folder).train, _data(folder), split="train", seed=0)
    assert prompts[1].sample == {**rows[1], "answer": "2"}  # the other columns reach the rewards
    with pytest.raises(
        RlbridgeError, match=r"data\.train\.split: .* no split 'dev'; its splits: train, test"
    ):
        _texts(_data(saved, split="dev"))
    with pytest.raises(RlbridgeError, match=r"data\.columns\.prompt: column 'problem' not in .*question"):
        _texts(_data_renamed(tmp_path))


def _data_renamed(tmp_path: Path) -> DataCfg:
    path = tmp_path / "renamed.json"
    path.write_text(json.dumps([{"question": "q", "solution": "1"}]))
    return _data(path)


def _hub_cache(home: Path, repo: str, config: str, splits: dict[str, list[dict[str, Any]]]) -> None:
    """The datasets cache an online `load_dataset(repo, config)` leaves behind, built from local parquet files."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = home / "src" / config
    src.mkdir(parents=True)
    files = {}
    for split, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(src / f"{split}.parquet")
        files[split] = str(src / f"{split}.parquet")
    name = repo.split("/")[1]
    builder = Parquet(
        cache_dir=str(home / "build"), dataset_name=name, config_name=config, data_files=files, hash="0" * 16
    )
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    target = home / "datasets" / repo.replace("/", "___") / config / built.parts[-2] / built.parts[-1]
    target.parent.mkdir(parents=True)
    shutil.move(str(built), target)


def test_hub_dataset_from_the_local_cache_offline(hf_home: Path) -> None:
    _hub_cache(hf_home, "toy-org/toy-math", "main", {"train": _rows(5), "test": _rows(8, 5)})
    cfg = DataCfg.model_validate(
        {
            "train": {"path": "toy-org/toy-math", "config": "main"},
            "val": {"path": "toy-org/toy-math", "config": "main", "split": "test"},
            "columns": {"prompt": "problem", "answer": "solution"},
        }
    )
    assert _texts(cfg) == [r["problem"] for r in _rows(5)]
    assert _texts(cfg, "val") == [r["problem"] for r in _rows(8, 5)]
    lazy = open_prompts(cfg.train, cfg, split="train", seed=0)
    assert not isinstance(lazy, list) and type(lazy.split.data).__name__ == "MemoryMappedTable"
    with pytest.raises(
        RlbridgeError, match=r"data\.train\.path: toy-org/absent is not a local path .*offline"
    ):
        _texts(_data("toy-org/absent"))
    with pytest.raises(DataError, match=r"data\.train\.config: .*'other'; its configurations: main") as e:
        _texts(_data("toy-org/toy-math", config="other"))
    assert e.value.key == "data.train.config" and e.value.fix == "set data.train.config to one of them"
    _hub_cache(hf_home, "toy-org/toy-math", "socratic", {"train": _rows(5)})
    with pytest.raises(DataError, match=r"data\.train\.config: .*several configurations: ") as e:
        _texts(_data("toy-org/toy-math"))  # two cached, none named
    assert "main" in e.value.message and "socratic" in e.value.message


def test_conversational_prompts_and_recipe_chat_template() -> None:
    tok = build_tiny_tokenizer(extra_words=("Be", "brief", "Hi", "there"))
    row = {
        "prompt": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "What is 1 + 1?"}],
        "answer": "2",
    }
    from rlbridge.data.datasets import Columns, to_prompt

    columns = Columns("prompt", "data.columns.prompt", "answer", "data.columns.answer")
    prompt = to_prompt(row, columns)
    assert isinstance(prompt, Prompt) and prompt.text == "What is 1 + 1?" and prompt.messages == row["prompt"]
    data = DataCfg.model_validate({"train": {"path": "x"}, "system_prompt": "ignored: the row has its own"})
    assert render_messages(prompt, data) == row["prompt"]
    want = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert encode_prompt(tok, prompt, data) == list(want)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    own = DataCfg.model_validate({"train": {"path": "x"}, "chat_template": template})
    assert tok.decode(encode_prompt(tok, prompt, own)).split() == [
        "Be",
        "brief",
        "What",
        "is",
        "1",
        "+",
        "1",
        "?",
    ]
    with pytest.raises(RlbridgeError, match="data.chat_template is false but the prompts are conversations"):
        encode_prompt(tok, prompt, DataCfg.model_validate({"train": {"path": "x"}, "chat_template": False}))
    bad = {**row, "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert "ends with an assistant message" in str(to_prompt(bad, columns))
    assert "message 0 is not" in str(to_prompt({**row, "prompt": [{"role": "user"}]}, columns))


def _lazy(tmp_path: Path, rows: list[dict[str, Any]], max_tokens: int = 100) -> LazyEncoded:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = _data(path, loader="datasets", chat_template=False)
    source = open_prompts(data.train, data, split="train", seed=0)
    assert not isinstance(source, list)
    words = tuple(w for r in rows for w in str(r["problem"]).split())
    return LazyEncoded(source, build_tiny_tokenizer(extra_words=words), data, max_tokens, cache_rows=8)


def test_lazy_rows_are_skipped_when_sampled_and_the_position_resumes_exactly(tmp_path: Path) -> None:
    rows = _rows(40)
    rows[3]["problem"] = ""  # unusable: empty prompt
    rows[7]["problem"] = " ".join(["What"] * 30)  # unusable: over max_prompt_tokens
    lazy = _lazy(tmp_path, rows, max_tokens=20)

    def sampler() -> PromptSampler:
        return PromptSampler(
            lazy.prompts,
            seed=5,
            shuffle=True,
            usable=lazy.usable_rows,
            fingerprint_of=lazy.source.fingerprint,
        )

    whole = sampler()
    batches = [whole.next_indices(7) for _ in range(15)]  # ~2.8 epochs: crosses epoch boundaries
    taken = [i for b in batches[:5] for i in b]
    assert 3 not in taken and 7 not in taken and len(set(taken)) == len(taken) == 35  # no repeat in an epoch
    assert lazy.prompts[batches[0][0]].text == rows[batches[0][0]]["problem"]
    assert lazy.skipped.count == 2 and "more than rollout.max_prompt_tokens 20" in str(lazy.skipped)
    for cut in (1, 4, 9):
        first = sampler()
        for _ in range(cut):
            first.next_indices(7)
        state = json.loads(json.dumps(first.state()))  # as the checkpoint manifest stores it
        resumed = sampler()
        resumed.load_state(state)
        assert [resumed.next_indices(7) for _ in range(15 - cut)] == batches[cut:]
    (tmp_path / "o").mkdir()
    other = _lazy(tmp_path / "o", [{**r, "solution": "x"} for r in rows], max_tokens=20)
    moved = PromptSampler(
        other.prompts, seed=5, usable=other.usable_rows, fingerprint_of=other.source.fingerprint
    )
    with pytest.raises(RlbridgeError, match="different prompts"):
        moved.load_state(whole.state())


def test_nothing_usable_is_an_error_not_a_hang(tmp_path: Path) -> None:
    lazy = _lazy(tmp_path, [{"problem": "", "solution": "1"}] * 3)
    sampler = PromptSampler(
        lazy.prompts, seed=0, usable=lazy.usable_rows, fingerprint_of=lazy.source.fingerprint
    )
    with pytest.raises(RlbridgeError, match="no row of the training data is usable"):
        sampler.next_indices(2)


def _issues(tmp_path: Path, data: dict[str, Any]) -> list[str]:
    """validate-recipe's data issues for the quickstart recipe with `data` merged in."""
    import yaml

    from rlbridge.recipe import load_recipe
    from rlbridge.recipe.checks import run_checks

    raw = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())
    raw["data"] = {**raw["data"], "template": "{prompt}", **data}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    issues, _ = run_checks(load_recipe(path), model_checks=False)
    return [f"{i.key}: {i.message}" for i in issues if i.key.startswith("data.")]


def test_validate_reads_the_first_rows(tmp_path: Path) -> None:
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in _rows(3)))
    assert _issues(tmp_path, {"train": {"path": str(jsonl)}}) == [
        "data.columns.prompt: column 'question' is not in data.train (rows.jsonl line 1; its columns: level, "
        "problem, solution)"
    ]
    ok = {"train": {"path": str(jsonl)}, "val": None, "columns": {"prompt": "problem", "answer": "solution"}}
    assert _issues(tmp_path, ok) == []
    assert _issues(tmp_path, {**ok, "template": "{prompt} (level {level})"}) == []
    assert _issues(tmp_path, {**ok, "template": "{prompt} {topic}"}) == [
        "data.template: names the field {topic}, but data.train line 1 has no such column"
    ]
    braces = _issues(tmp_path, {**ok, "template": '{prompt} Reply as {"answer": 1}'})
    assert len(braces) == 1 and braces[0].startswith("data.template: ")
    csv = tmp_path / "rows.csv"
    datasets.Dataset.from_list(_rows(3)).to_csv(csv)
    assert _issues(
        tmp_path, {**ok, "train": {"path": str(csv)}, "val": {"path": str(csv), "answer_key": "x"}}
    ) == [
        "data.val.answer_key: column 'x' is not in data.val (rows.csv row 1; its columns: problem, solution, level)"
    ]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}))
    conv = {"train": {"path": str(chat)}, "columns": {"prompt": "prompt"}}
    assert _issues(tmp_path, conv) == []
    assert [
        i.split(":")[0] for i in _issues(tmp_path, {**conv, "template": "{prompt}!", "chat_template": False})
    ] == [
        "data.template",
        "data.chat_template",
    ]
    assert _issues(tmp_path, {**conv, "chat_template": "{% for m in messages %}"})[0].startswith(
        "data.chat_template: not a valid Jinja template"
    )
    missing = _issues(tmp_path, {"train": {"path": "toy-org/absent"}})
    assert len(missing) == 1 and missing[0].startswith("data.train.path: toy-org/absent is not a local path")


def test_validate_checks_the_columns_a_batched_reward_takes(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"problem": "What is 1 + 1?", "solution": "2"}))
    data = {"train": {"path": str(rows)}, "columns": {"prompt": "problem", "answer": "solution"}}
    reward = {
        "terms": [
            {"fn": "tests.fixtures.trl_rewards:reward_len"},
            {"fn": "tests.fixtures.trl_rewards:reward_func"},
        ]
    }
    assert _issues_with(tmp_path, data, reward) == [
        "reward.terms.1.fn: the batched function takes the column 'ground_truth' by name, but data.train line 1 "
        "has no such column (columns besides the prompt: solution)"
    ]


def _issues_with(tmp_path: Path, data: dict[str, Any], reward: dict[str, Any]) -> list[str]:
    import yaml

    from rlbridge.recipe import load_recipe
    from rlbridge.recipe.checks import run_checks

    raw = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())
    raw["data"] = {**raw["data"], "template": "{prompt}", **data}
    raw["reward"] = reward
    raw.pop("eval")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    issues, _ = run_checks(load_recipe(path), model_checks=False)
    return [f"{i.key}: {i.message}" for i in issues]
