"""TRL-style batched reward functions run unchanged: functions copied verbatim from TRL 1.16 (tests/fixtures/
trl_rewards.py) get the batch's prompts, completions, completion ids and the dataset's other columns as keyword
lists, as TRL's GRPOTrainer calls `reward_funcs`, next to per-sample functions and builtins."""

from __future__ import annotations

from typing import Any

import pytest

from rlbridge.data.datasets import Prompt
from rlbridge.data.reward_pool import RewardPool
from rlbridge.data.rewards import batch_kwargs, check_reward_fn, is_batched, resolve_reward_fn
from rlbridge.recipe.schema import RewardCfg

FIX = "tests.fixtures.trl_rewards"
ACC = "tests.fixtures.trl_accuracy_reward:accuracy_reward"


def _batch(prompts: list[Prompt], completions: list[str], n: int = 1) -> dict[str, Any]:
    """What collect.reward_batch builds: every prompt n times, the raw rows, the prompt column left out."""
    return batch_kwargs(
        [p.messages if p.messages is not None else p.text for p in prompts for _ in range(n)],
        completions,
        [p.row for p in prompts for _ in range(n)],
        prompt_column="prompt",
        completion_ids=[[7] * len(c.split()) for c in completions],
    )


def _prompt(question: str, solution: str) -> Prompt:
    messages = [{"role": "user", "content": question}]
    row = {"prompt": messages, "solution": solution, "level": 2}
    return Prompt(text=question, answer=solution, row=row, messages=messages)


def test_trl_functions_are_detected_and_validated() -> None:
    for spec in [f"{FIX}:{n}" for n in ("think_format_reward", "reward_len", "soft_overlong_punishment")]:
        assert check_reward_fn(spec) is None, spec
        assert is_batched(resolve_reward_fn(spec)), spec
    assert "3 positional arguments" in str(check_reward_fn(f"{FIX}:reward_len", batched=False))
    assert "scores one sample at a time" in str(check_reward_fn("gsm8k", batched=True))
    assert "takes no **kwargs" in str(check_reward_fn("tests.fixtures.toy_rewards:length", batched=True))


def test_batch_kwargs_are_trls() -> None:
    prompts = [_prompt("What is 1 + 1?", "2"), _prompt("What is 2 + 2?", "4")]
    kw = _batch(prompts, ["a", "b", "c", "d"], n=2)
    assert kw["prompts"] == [prompts[0].messages] * 2 + [prompts[1].messages] * 2
    assert kw["completions"] == [[{"role": "assistant", "content": c}] for c in "abcd"]
    assert kw["solution"] == ["2", "2", "4", "4"] and kw["level"] == [2] * 4 and "prompt" not in kw
    plain = batch_kwargs(["q"], ["a"], [{"question": "q", "answer": 3}], prompt_column="question")
    assert plain["completions"] == ["a"] and plain["answer"] == [3] and "question" not in plain


def test_trl_functions_score_beside_per_sample_terms() -> None:
    cfg = RewardCfg.model_validate(
        {
            "terms": [
                {"fn": f"{FIX}:think_format_reward", "weight": 1.0},
                {"fn": ACC, "weight": 2.0},
                {"fn": f"{FIX}:soft_overlong_punishment", "weight": 1.0},
                {"fn": "tests.fixtures.toy_rewards:length", "weight": 0.0},  # per sample, in the workers
                {"fn": "format", "weight": 0.5},  # builtin, in-process
            ],
            "workers": 1,
        }
    )
    prompts = [_prompt("What is 1 + 1?", "2"), _prompt("Name a colour.", "not latex: red")]
    completions = [
        "<think>\nadd\n</think>\nSo \\boxed{2} #### 2",  # format, right, 8 words: overlong -1
        "no think \\boxed{3}",  # wrong, 3 words
        "<think>x</think> red",  # gold unparseable: accuracy None (skipped)
        "red",
    ]
    rows = [p.sample for p in prompts for _ in range(2)]
    with RewardPool(cfg) as pool:
        assert pool.has_batched and pool.batched == [True, True, True, False, False]
        res = pool.score(
            [p.text for p in prompts for _ in range(2)],
            completions,
            rows,
            batch=_batch(prompts, completions, n=2),
        )
    assert res.num_errors == 0, res.errors
    assert res.terms[f"{FIX}:think_format_reward"] == [1.0, 0.0, 1.0, 0.0]
    assert res.terms[ACC] == [1.0, 0.0, None, None]
    assert res.terms[f"{FIX}:soft_overlong_punishment"] == [-1.0, 0.0, 0.0, 0.0]
    assert res.terms["format"] == [1.0, 0.0, 0.0, 0.0]
    assert res.scores == pytest.approx([1.0 + 2.0 - 1.0 + 0.5, 0.0, 1.0, 0.0])


def test_a_failing_or_misshapen_batched_function_fails_its_term_on_every_sample() -> None:
    cfg = RewardCfg.model_validate(
        {"terms": [{"fn": f"{FIX}:think_format_reward"}, {"fn": f"{FIX}:reward_len"}], "workers": 1}
    )
    with RewardPool(cfg) as pool:
        # plain string prompts: completions are strings, as in TRL's quickstart, which reward_len expects and
        # think_format_reward (written for conversations) fails on: a TypeError on every sample of its term
        res = pool.score(["q", "q"], ["ab", "x" * 20], [{}, {}])
    assert res.terms[f"{FIX}:reward_len"] == [-18.0, 0.0]
    assert res.num_errors == 2 and res.scores == [None, None] and "TypeError" in (res.last_traceback or "")
