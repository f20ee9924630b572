"""Reward functions: builtin parsing (golden cases and the whole GSM8K test set), validation of user
functions, and RewardPool's isolation of misbehaving ones (raise, NaN, non-number, hang, output, exit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from rlbridge.data.reward_pool import RewardBudgetExceeded, RewardPool
from rlbridge.data.rewards import (
    BUILTINS,
    arithmetic_reward,
    check_reward_fn,
    extract_answer,
    format_reward,
    gsm8k_reward,
    last_number,
    parse_number,
    resolve_reward_fn,
)
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import RewardCfg, RewardTerm

REPO = Path(__file__).resolve().parents[3]
GSM8K_DIR = Path(os.environ.get("RLBRIDGE_GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k"))
FIX = "tests.fixtures.reward_fns"


# ------------------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1234", 1234),
        ("1,234", 1234),
        ("$1,234.00", 1234),
        ("1234.", 1234),
        (" -5 ", -5),
        ("-$5", -5),
        ("3.50", Fraction(7, 2)),
        ("0.5", Fraction(1, 2)),
        ("12 apples", None),
        ("1,23", None),
        ("", None),
    ],
)
def test_parse_number(text: str, value: Fraction | int | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,2,3", 3),
        ("10-5", 5),
        ("x = -5", -5),
        ("1,2345", 2345),
        ("it is 5.", 5),
        ("no digits", None),
        ("f(3)-2", 2),
        ("costs $12.50 each", Fraction(25, 2)),
    ],
)
def test_last_number(text: str, value: Fraction | int | None) -> None:
    assert last_number(text) == value


@pytest.mark.parametrize(
    ("completion", "value"),
    [
        ("so 3 + 4 = 7\n#### 7", 7),
        ("#### $1,234.00.", 1234),
        ("#### 5 then more text 9", 5),
        ("#### maybe\nThe answer is 12", 12),
        ("The final answer is: 42, not 41", 42),
        ("we get \\boxed{18} and 20 more", 18),
        ("first 3 then 4", 4),
        ("#### 1\n#### 2", 2),
        ("nothing", None),
    ],
)
def test_extract_answer(completion: str, value: int | None) -> None:
    assert extract_answer(completion) == value


def test_builtin_golden_cases() -> None:
    gold = {"answer": "She sells 16 - 3 - 4 = 9 eggs.\n#### 1,234"}
    assert gsm8k_reward("", "The answer is 1,234.", gold) == 1.0
    assert gsm8k_reward("", "#### 1234", {"answer": "1234"}) == 1.0  # no ####: the whole answer
    assert gsm8k_reward("", "1234 apples, but the answer is 12", gold) == 0.0
    assert gsm8k_reward("", "#### 1235", gold) == 0.0
    assert gsm8k_reward("", "", gold) == 0.0
    assert arithmetic_reward("", "47 + 38 = 85", {"answer": "85"}) == 1.0
    assert arithmetic_reward("", "85 is wrong, #### 84", {"answer": "85"}) == 0.0
    assert arithmetic_reward("", "#### -35", {"answer": "-35"}) == 1.0
    assert arithmetic_reward("", "#### 85.0", {"answer": 85}) == 1.0
    assert format_reward("", "reasoning\n#### 5", {}) == 1.0
    assert format_reward("", "#### 5\n#### 6", {}) == 0.0
    assert format_reward("", "#### five", {}) == 0.0
    with pytest.raises(ValueError, match="no 'answer' field"):
        gsm8k_reward("", "#### 1", {"question": "q"})
    with pytest.raises(ValueError, match="no number"):
        arithmetic_reward("", "#### 1", {"answer": "n/a"})


def _gsm8k_rows() -> list[dict[str, Any]]:
    path = GSM8K_DIR / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K test set not found at {path} (set RLBRIDGE_GSM8K_DIR)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_gsm8k_reward_on_the_whole_test_set() -> None:
    rows = _gsm8k_rows()
    assert len(rows) == 1319
    misses = []
    for i, row in enumerate(rows):
        gold = int(row["answer"].split("#### ")[-1].strip().replace(",", ""))
        positives = [
            f"The answer is {gold:,}.",
            f"#### {gold}",
            f"${gold}",
            f"So the total is ${gold:,}.00",
            f"\\boxed{{{gold}}}",
            row["answer"],
        ]
        negatives = [f"#### {gold + 1}", f"The answer is {gold * 10 + 7:,}.", "I do not know."]
        misses += [(i, c, 1.0) for c in positives if gsm8k_reward(row["question"], c, row) != 1.0]
        misses += [(i, c, 0.0) for c in negatives if gsm8k_reward(row["question"], c, row) != 0.0]
    assert not misses, f"{len(misses)} wrong, e.g. {misses[:5]}"


# --------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("spec", [*BUILTINS, f"{FIX}:good", f"{FIX}:flexible"])
def test_check_reward_fn_accepts(spec: str) -> None:
    assert check_reward_fn(spec) is None
    assert callable(resolve_reward_fn(spec))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gsm8", "did you mean 'gsm8k'"),
        ("no_such_module_rlb:fn", "cannot import module 'no_such_module_rlb'"),
        (f"{FIX}:missing", "has no attribute 'missing'"),
        (f"{FIX}:two_args", "must accept 3 positional arguments"),
        (f"{FIX}:keyword_sample", "must accept 3 positional arguments"),
        (f"{FIX}:NOT_CALLABLE", "is a int, not a function"),
        (f"{FIX}:async_reward", "is async"),
        ("mod:", "not of the form package.module:function"),
        ("a:b:c", "not of the form package.module:function"),
        ("my-mod:fn", "not of the form package.module:function"),
        ("", "must be a builtin name"),
    ],
)
def test_check_reward_fn_rejects(spec: str, message: str) -> None:
    problem = check_reward_fn(spec)
    assert problem is not None and message in problem, problem
    with pytest.raises(RlbridgeError, match="reward function"):
        resolve_reward_fn(spec)


def test_check_reward_fn_never_raises_on_non_strings() -> None:
    assert "must be a builtin name" in str(check_reward_fn(None))  # type: ignore[arg-type]


def test_rewards_module_imports_only_the_standard_library() -> None:
    code = (
        "import sys, rlbridge.data.rewards; "
        "print([m for m in ('torch', 'transformers', 'numpy', 'math_verify', 'pydantic') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------- pool
def _pids(pool: RewardPool) -> set[int]:
    return {w.proc.pid for w in pool._workers}


def _dead(pid: int) -> bool:
    """Gone or a zombie (an orphan may wait for a container's init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_pool_isolates_every_kind_of_failure(capfd: pytest.CaptureFixture[str]) -> None:
    modes = [None, "raise", None, "nan", "str", None, "sleep", "print", None, "exit", "os_exit", None]
    samples = [{"answer": str(i), **({"mode": m} if m else {})} for i, m in enumerate(modes)]
    completions = [str(i) if i % 3 else "wrong" for i in range(len(modes))]
    expected_errors = {
        1: "ValueError: reward exploded on purpose",
        3: "returned nan, not a finite number",
        4: "returned str '1.0', not a float",
        6: "ran past reward.timeout_s=1.0s",
        9: "SystemExit: 3",
        10: "exited with code 7",
    }
    cfg = RewardCfg(fn=f"{FIX}:chaos", timeout_s=1.0, workers=2, error_budget=100)
    with RewardPool(cfg) as pool:
        first = _pids(pool)
        result = pool.score(["p"] * len(modes), completions, samples)
        assert result.num_errors == len(expected_errors) == pool.total_errors
        for i, score in enumerate(result.scores):
            assert score == (None if i in expected_errors else float(i % 3 != 0)), (i, result.errors)
        for line, (i, text) in zip(result.errors, sorted(expected_errors.items()), strict=True):
            assert line.startswith(f"sample {i}, {FIX}:chaos: ") and text in line, line
        assert "exited with code 7" in str(result.last_traceback)
        assert len(pool._workers) == 2 and all(
            _dead(pid) for pid in first - _pids(pool)
        )  # hung/exited ones replaced
        before = _pids(pool)
        again = pool.score(["p"] * 3, ["0", "x", "2"], [{"answer": "0"}, {"answer": "1"}, {"answer": "2"}])
        assert again.scores == [1.0, 0.0, 1.0] and again.num_errors == 0
        assert _pids(pool) == before  # workers are reused across calls
    assert all(_dead(pid) for pid in before)
    captured = capfd.readouterr()
    assert len(captured.out) + len(captured.err) < 10_000  # the megabytes went to /dev/null


def test_timeout_kills_what_the_function_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    samples: list[dict[str, Any]] = [{"answer": "1", "bad": True, "pid_file": str(pid_file)}, {"answer": "2"}]
    with RewardPool(RewardCfg(fn=f"{FIX}:spawning", timeout_s=1.0, workers=2)) as pool:
        result = pool.score(["p", "p"], ["1", "2"], samples)
        assert result.scores == [None, 1.0] and "ran past reward.timeout_s" in result.errors[0]
        assert _dead(int(pid_file.read_text()))


def test_error_budget_raises_with_the_traceback() -> None:
    cfg = RewardCfg(fn=f"{FIX}:raising", timeout_s=5.0, workers=1, error_budget=1)
    samples: list[dict[str, Any]] = [{"answer": "1"}, {"answer": "2", "bad": True}]
    with RewardPool(cfg) as pool:
        assert pool.score(["p", "p"], ["1", "2"], samples).scores == [1.0, None]
        with pytest.raises(RewardBudgetExceeded) as info:
            pool.score(["p", "p"], ["1", "2"], samples)
    message = str(info.value)
    assert "2 reward errors so far exceed reward.error_budget=1" in message
    assert "Traceback" in message and 'raise ValueError("reward exploded on purpose")' in message
    assert isinstance(info.value, RlbridgeError)


def test_weighted_terms_mix_builtins_and_user_functions() -> None:
    terms = [
        RewardTerm(fn="gsm8k"),
        RewardTerm(fn="format", weight=0.5),
        RewardTerm(fn=f"{FIX}:half", weight=2.0),
    ]
    with RewardPool(RewardCfg(terms=terms, workers=1)) as pool:
        result = pool.score(["q"] * 3, ["#### 7", "it is 7", "#### 8"], [{"answer": "#### 7"}] * 3)
    assert result.scores == [2.5, 2.0, 1.5]
    assert result.terms == {"gsm8k": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0], f"{FIX}:half": [0.5] * 3}


def test_builtin_only_pool_runs_in_process_and_counts_errors() -> None:
    with RewardPool(RewardCfg(fn="arithmetic", error_budget=5)) as pool:
        assert pool._workers == []
        result = pool.score(["q", "q"], ["#### 85", "#### 85"], [{"answer": "85"}, {"question": "no answer"}])
        assert result.scores == [1.0, None] and result.num_errors == 1
        assert "no 'answer' field" in result.errors[0] and pool._workers == []
        assert pool.score([], [], []).scores == []


def test_pool_rejects_bad_specs_and_mismatched_batches() -> None:
    with pytest.raises(RlbridgeError, match="has no attribute 'missing'"):
        RewardPool(RewardCfg(fn=f"{FIX}:missing"))
    with pytest.raises(ValueError, match="2 prompts, 1 completions"):
        RewardPool(RewardCfg(fn="gsm8k")).score(["a", "b"], ["c"], [{}])
