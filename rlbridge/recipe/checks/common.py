"""What every rule module shares: the issue list type and small number helpers."""

from __future__ import annotations

from rlbridge.errors import RecipeIssue

Issues = list[RecipeIssue]
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choices(values: list[int], limit: int = 6) -> str:
    shown = [str(v) for v in values[:limit]]
    return " or ".join(shown) if len(shown) <= 2 else ", ".join(shown[:-1]) + " or " + shown[-1]
