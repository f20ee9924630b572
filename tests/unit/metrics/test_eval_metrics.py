"""Evaluation from the recipe: eval.metrics (term means, pass rates, pass@k), their checks, and what the console and
the report print. pass@k is checked against a brute-force count over every k-subset of the samples."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from rlbridge.batch import Rollouts
from rlbridge.data.datasets import Prompt
from rlbridge.data.reward_pool import RewardPool, RewardResult
from rlbridge.loop import evaluate
from rlbridge.metrics.evals import eval_columns, eval_metric
from rlbridge.metrics.log import _eval_line
from rlbridge.recipe import load_recipe
from rlbridge.recipe.checks import run_checks
from rlbridge.recipe.schema import EvalMetric, RewardCfg

REWARD = RewardCfg.model_validate({"terms": [{"fn": "arithmetic"}, {"fn": "format", "weight": 0.5}]})


def _result(arith: list[float | None], fmt: list[float | None]) -> RewardResult:
    scores = [None if a is None or f is None else a + 0.5 * f for a, f in zip(arith, fmt, strict=True)]
    return RewardResult(scores=scores, num_errors=0, terms={"arithmetic": arith, "format": fmt})


def test_means_pass_rates_and_pass_at_k() -> None:
    res = _result([1.0, 0.0, None, 1.0], [1.0, 1.0, 0.0, 0.0])
    assert eval_metric(EvalMetric(term="arithmetic"), res, REWARD, n=1) == pytest.approx(
        2 / 3
    )  # unscored: out
    assert (
        eval_metric(EvalMetric(term="arithmetic", threshold=1.0), res, REWARD, n=1) == 0.5
    )  # unscored fails
    assert eval_metric(EvalMetric(), res, REWARD, n=1) == pytest.approx((1.5 + 0.5 + 1.0) / 3)
    # pass@k from n = 5 samples per prompt: the unbiased estimator equals the share of k-subsets with a pass
    groups = [[1.0, 0.0, 0.0, 1.0, 0.0], [0.0] * 5, [1.0] * 5, [0.0, None, 1.0, 0.0, 0.0]]
    values = [v for g in groups for v in g]
    res = _result(values, [0.0] * len(values))
    for k in (1, 2, 3, 5):
        brute = sum(
            sum(any(v is not None and v >= 1.0 for v in subset) for subset in itertools.combinations(g, k))
            / math.comb(5, k)
            for g in groups
        ) / len(groups)
        got = eval_metric(EvalMetric(term="arithmetic", threshold=1.0, k=k), res, REWARD, n=5)
        assert got == pytest.approx(brute), k
    assert EvalMetric(term="pkg.mod:score", threshold=0.5, k=4).key == "eval_score_pass@4"
    assert EvalMetric(term="arithmetic", threshold=1.0).key == "eval_arithmetic_pass_rate"
    with pytest.raises(ValueError, match="pass@4 needs a threshold"):
        EvalMetric(term="arithmetic", k=4)


def _issues(tmp_path: Path, **sections: Any) -> list[str]:
    raw = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())
    raw.update(sections)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    issues, _ = run_checks(load_recipe(path), model_checks=False)
    return [f"{i.key}: {i.message}" for i in issues]


def test_checks(tmp_path: Path) -> None:
    assert _issues(tmp_path) == []
    metrics = [
        {"term": "gsm8k"},
        {"term": "arithmetic", "threshold": 1.0, "name": "accuracy"},
        {"term": "format", "threshold": 1.0, "name": "accuracy"},
    ]
    assert _issues(tmp_path, eval={"metrics": metrics}) == [
        "eval.metrics.0.term: not a term of the reward",
        "eval.metrics.2.name: eval.metrics.1 has the same name (eval_accuracy)",
    ]
    greedy = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())["rollout"] | {"temperature": 0.0}
    pass_at_4 = {"metrics": [{"term": "arithmetic", "threshold": 1.0, "k": 4}]}
    assert "eval.metrics.0.k" in [i.split(":")[0] for i in _issues(tmp_path, eval=pass_at_4, rollout=greedy)]
    data = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())["data"]
    del data["val"]
    assert _issues(tmp_path, eval=pass_at_4, data=data)[0].startswith("eval.metrics: there is no data.val")


class _Session:
    """What loop.evaluate uses of a Session: validation prompts, a rollout that answers `answers` (greedy) or
    cycles through `sampled`, the real reward pool (builtins, in-process), and the metrics log."""

    def __init__(self, recipe: Any, answers: list[str], sampled: list[str]) -> None:
        self.recipe, self.answers, self.sampled = recipe, answers, sampled
        prompts = [
            Prompt(
                text=f"{i} + {i}?", answer=str(2 * i), row={"question": f"{i} + {i}?", "answer": str(2 * i)}
            )
            for i in range(len(answers))
        ]
        self.val_data = SimpleNamespace(prompts=prompts, ids=[[i] for i in range(len(prompts))])
        self.rewards = RewardPool(recipe.reward)
        self.records: list[dict[str, Any]] = []
        self.metrics = SimpleNamespace(write=self.records.append)
        self.calls: list[tuple[bool, int | None]] = []

    @contextlib.contextmanager
    def stall(self, phase: str) -> Iterator[None]:
        yield

    def generate(
        self, ids: list[list[int]], *, greedy: bool = False, seed: int | None = None, n: int | None = None
    ):
        self.calls.append((greedy, n))
        texts = (
            self.answers
            if greedy
            else [self.sampled[j % len(self.sampled)] for j in range(len(ids) * (n or 1))]
        )
        return Rollouts(
            [[0]] * len(texts), [[1]] * len(texts), [[0.0]] * len(texts), ["stop"] * len(texts), 0, texts
        )


def test_evaluate_writes_what_the_recipe_names(tmp_path: Path) -> None:
    raw = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())
    raw["eval"] = {
        "metrics": [
            {"term": "arithmetic", "threshold": 1.0, "name": "accuracy"},
            {"term": "format"},
            {"term": "arithmetic", "threshold": 1.0, "k": 2},
        ]
    }
    raw["run"]["eval_samples"] = 3
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    recipe = load_recipe(path)
    # greedy: prompt 0 right with the marker, 1 right without it, 2 wrong; sampled: 2 per prompt, "#### 0" then
    # "#### 2": prompt 1 (answer 2) passes pass@2, prompt 0 (answer 0) too, prompt 2 (answer 4) does not
    s = _Session(recipe, ["#### 0", "2", "#### 5"], ["#### 0", "#### 2"])
    out = evaluate(s, step=3)  # type: ignore[arg-type]
    assert s.calls == [(True, None), (False, 2)]
    assert list(out) == ["eval_accuracy", "eval_format", "eval_arithmetic_pass@2", "eval_samples"]
    assert out["eval_accuracy"] == pytest.approx(2 / 3) and out["eval_format"] == pytest.approx(2 / 3)
    assert out["eval_arithmetic_pass@2"] == pytest.approx(2 / 3) and out["eval_samples"] == 3
    (record,) = s.records
    assert record["kind"] == "eval" and record["step"] == 3
    line = _eval_line(record, eval_columns(recipe.model_dump(mode="json")))
    assert line.startswith("[bold cyan]eval[/] step 3: accuracy 66.7%, format 0.667, arithmetic_pass@2 66.7%")
    # an older run (no eval section, fixed metrics): the report still finds them
    legacy = [{"kind": "eval", "step": 0, "eval_accuracy": 0.5, "eval_format": 1.0, "eval_reward": 0.7}]
    assert [c.key for c in eval_columns({}, legacy)] == ["eval_reward", "eval_accuracy", "eval_format"]


def test_train_accuracy_is_the_first_pass_rate_the_recipe_names(tmp_path: Path) -> None:
    from rlbridge.metrics.evals import train_accuracy

    raw = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    res = _result([1.0, 0.0, None, 1.0], [0.0, 1.0, 1.0, 1.0])
    assert train_accuracy(load_recipe(path), res) == {
        "accuracy": 0.5
    }  # arithmetic >= 1.0 (quickstart's accuracy)
    raw.pop("eval")
    path.write_text(yaml.safe_dump(raw))
    assert train_accuracy(load_recipe(path), res) == {}  # no pass rate named: no accuracy, no implied task
