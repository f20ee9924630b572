"""What every rule module shares: the issue list type and small number helpers."""

from __future__ import annotations

from rlbridge.errors import RecipeIssue
from rlbridge.rollout.vllm_spec import VLLM_LORA_RANKS as VLLM_LORA_RANKS

Issues = list[RecipeIssue]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choices(values: list[int], limit: int = 6) -> str:
    shown = [str(v) for v in values[:limit]]
    return " or ".join(shown) if len(shown) <= 2 else ", ".join(shown[:-1]) + " or " + shown[-1]
