"""`builtin:arithmetic`: a seeded, generated task for smoke runs and learning checks without data files.

Problems look like "What is 47 + 38?" with answer "85" (subtraction may give negative answers). Train and
val are drawn from one seeded stream of distinct problems, train first, so the two splits never share a
problem text and neither repeats one; both depend only on the seed and `data.arithmetic`.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from typing import Any, Literal

from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import ArithmeticCfg

Problem = tuple[int, str, int]
_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _operands(digits: int) -> range:
    return range(0, 10) if digits == 1 else range(10 ** (digits - 1), 10**digits)


def _distinct_problems(cfg: ArithmeticCfg, seed: int, needed: int) -> list[Problem]:
    ops: list[str] = list(dict.fromkeys(cfg.ops))
    values = _operands(cfg.digits)
    capacity = len(values) ** 2 * len(ops)
    if needed > capacity:
        raise RlbridgeError(
            f"data.arithmetic.num_train: {needed} problems (num_train + num_val) requested but digits="
            f"{cfg.digits} with ops {ops} has only {capacity} distinct ones; lower num_train/num_val or raise "
            "data.arithmetic.digits"
        )
    rng = random.Random(f"rlbridge-arithmetic-{seed}")
    if capacity <= 4 * needed:  # small space: shuffle all of it rather than reject-sample
        every = [(a, op, b) for op in ops for a in values for b in values]
        rng.shuffle(every)
        return every[:needed]
    seen: set[Problem] = set()
    problems: list[Problem] = []
    while len(problems) < needed:
        problem = (rng.choice(values), rng.choice(ops), rng.choice(values))
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    return problems


def arithmetic_rows(cfg: ArithmeticCfg, *, split: Literal["train", "val"], seed: int) -> list[dict[str, Any]]:
    """Rows {question, answer, a, op, b} of one split; the same (cfg, seed) always gives the same rows."""
    problems = _distinct_problems(cfg, seed, cfg.num_train + cfg.num_val)
    chosen = problems[: cfg.num_train] if split == "train" else problems[cfg.num_train :]
    return [
        {"question": f"What is {a} {op} {b}?", "answer": str(_OPS[op](a, b)), "a": a, "op": op, "b": b}
        for a, op, b in chosen
    ]
