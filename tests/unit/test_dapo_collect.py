"""DAPO's collect step in the loop (rlbridge.collect.collect) on a scripted session: the soft overlong penalty
is added to the rewards, all-equal groups are dropped and the batch is refilled from further prompts (at most
max_refill_rounds extra rounds), and a batch still short is trained as it is, with the metrics saying so."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbridge.batch import Rollouts
from rlbridge.collect import collect
from rlbridge.metrics.log import Timer
from rlbridge.pipeline import RolloutSource
from rlbridge.recipe.schema import Recipe

N, MAX_LEN = 2, 10


def recipe(reward: dict[str, Any] | None = None, **algo: Any) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": "x"},
            "rollout": {"n": N, "max_response_tokens": MAX_LEN},
            "algorithm": {"name": "dapo", **algo},
            "reward": reward or {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
        }
    )


class Script:
    """Prompt i: its group's completions are `flat` (all-equal rewards) when i is in `flat`, else differ.
    Completion j of prompt i has (i + j) % (MAX_LEN + 1) tokens."""

    def __init__(self, r: Recipe, flat: set[int]) -> None:
        self.recipe, self.flat, self.calls = r, flat, 0
        self.pos = 0
        self.train_data = SimpleNamespace(
            prompts=[SimpleNamespace(text=f"p{i}", sample={}) for i in range(100)],
            ids=[[i] for i in range(100)],
        )
        self.sampler = SimpleNamespace(next_indices=self.next_indices)
        self.rewards = SimpleNamespace(score=self.score, has_batched=False)
        self.model_errors = 0

    def next_indices(self, k: int) -> list[int]:
        self.pos += k
        return list(range(self.pos - k, self.pos))

    def generate(self, ids: list[list[int]], seed: int) -> Rollouts:
        self.calls += 1
        p, resp, texts = [], [], []
        for (i,) in ids:
            for j in range(N):
                p.append([i])
                resp.append([1] * ((i + j) % (MAX_LEN + 1)))
                texts.append("0" if i in self.flat else str(j))
        return Rollouts(p, resp, [[0.0] * len(x) for x in resp], ["stop"] * len(resp), 0, texts)

    def score(self, prompts: list[str], completions: list[str], rows: list[Any], batch: Any = None) -> Any:
        return SimpleNamespace(
            scores=[float(c) for c in completions],
            terms={},
            num_errors=self.model_errors,
            errors=[],
            model_seconds=0.25,
            model_errors=self.model_errors,
        )


def run(r: Recipe, flat: set[int]) -> tuple[Script, Rollouts, torch.Tensor, dict[str, float]]:
    s = Script(r, flat)
    out = collect(s, 1, Timer(), lambda: False, RolloutSource(s))  # type: ignore[arg-type]
    assert out is not None
    return s, *out


def test_drops_all_equal_groups_and_refills() -> None:
    s, ro, rewards, m = run(recipe(), flat={0, 2, 5})
    # round 0: prompts 0-3, keeps 1, 3; round 1: prompts 4, 5 keeps 4; round 2: prompt 6
    assert len(ro) == 4 * N and [p[0] for p in ro.prompt_ids[::N]] == [1, 3, 4, 6]
    assert m["groups_dropped"] == 3 and m["refill_rounds"] == 2 and m["groups_short"] == 0 and s.calls == 3
    assert rewards.view(-1, N).std(dim=1).min() > 0


def test_short_after_max_refill_rounds_trains_on_what_is_there() -> None:
    s, ro, rewards, m = run(recipe(max_refill_rounds=1), flat=set(range(0, 100, 2)) | {1, 3})
    # round 0: 0-3 all flat; round 1: 4-7 keeps 5, 7; no more rounds
    assert [p[0] for p in ro.prompt_ids[::N]] == [5, 7] and len(rewards) == 2 * N
    assert m["groups_short"] == 2 and m["groups_trained"] == 2 and m["refill_rounds"] == 1 and s.calls == 2


def test_all_flat_trains_the_last_round_with_zero_signal() -> None:
    _, ro, rewards, m = run(recipe(max_refill_rounds=1), flat=set(range(100)))
    assert len(ro) == 4 * N and m["groups_trained"] == 0 and m["groups_short"] == 4
    assert (rewards.view(-1, N).std(dim=1) == 0).all()


def test_no_dynamic_sampling_keeps_everything() -> None:
    s, ro, _, m = run(recipe(dynamic_sampling=False), flat={0, 1, 2, 3})
    assert len(ro) == 4 * N and m["groups_dropped"] == 0 and m["refill_rounds"] == 0 and s.calls == 1


def test_overlong_penalty_is_added() -> None:
    _, ro, rewards, m = run(
        recipe(dynamic_sampling=False, overlong={"buffer": 4, "penalty": 1.0}), flat=set()
    )
    lengths = torch.tensor([len(x) for x in ro.response_ids], dtype=torch.float32)
    raw = torch.tensor([float(j) for _ in range(4) for j in range(N)])
    expected = raw - ((lengths - (MAX_LEN - 4)) / 4).clamp(0, 1)
    assert torch.allclose(rewards, expected)
    assert m["overlong_penalty"] == pytest.approx(float((expected - raw).mean()))
    assert m["reward_mean"] == pytest.approx(float(raw.mean()))  # reported before the penalty


def test_a_reward_models_seconds_and_failures_add_up_over_the_refills() -> None:
    """reward_model_s and reward_model_error (only with a reward model term) are summed over the rounds, as
    reward_error is, not averaged as the rewards are."""
    assert "reward_model_s" not in run(recipe(), flat={0, 2, 5})[3]
    s = Script(recipe({"terms": [{"model": "org/rm"}]}), flat={0, 2, 5})
    s.model_errors = 1
    out = collect(s, 1, Timer(), lambda: False, RolloutSource(s))  # type: ignore[arg-type]
    assert out is not None and s.calls == 3
    m = out[2]
    assert m["reward_model_s"] == pytest.approx(0.75) and m["reward_model_error"] == m["reward_error"] == 3
