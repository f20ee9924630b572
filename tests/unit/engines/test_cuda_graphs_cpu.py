"""trainer.cuda_graphs without a GPU: what can be checked on a CPU (the recording itself runs in
tests/gpu/test_gpu_cuda_graphs.py). An engine asked for graphs off CUDA refuses with the key's name; which passes
get recorded (PassGraphs.key): small enough, no replayed experts, one key per (rows, P, R, entropy gradient)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.engines.base import TrainEngine
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.engines.hf.graphs import PassGraphs, likely_widths, shape_batch
from rlbridge.engines.micro import forward_batch
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import MAX_PASS_TOKENS, Recipe
from rlbridge.trainer.role import TrainerRole
from tests.fixtures.tiny_llama import build_tiny_llama


def test_an_engine_off_cuda_refuses_graphs_by_name(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path)
    raw = {"name": "t", "model": {"path": str(model), "dtype": "float32"},
           "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]}, "trainer": {"cuda_graphs": True},
           "rollout": {"n": 2}, "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 2},
           "cluster": {"device": "cpu"}}  # fmt: skip
    with pytest.raises(RlbridgeError, match="trainer.cuda_graphs needs a CUDA device"):
        HFTrainEngine(Recipe.model_validate(raw), model)


def test_which_passes_are_recorded_under_which_key() -> None:
    def batch(rows: int, prompt: int, response: int) -> SeqBatch:
        return SeqBatch.from_token_lists([[1] * prompt] * rows, [[2] * response] * rows, pad_id=0)

    assert PassGraphs.key(batch(32, 48, 48), False) == (32, 48, 48, False)
    assert PassGraphs.key(batch(32, 48, 48), True) == (
        32,
        48,
        48,
        True,
    )  # the entropy's gradient: another graph
    width = MAX_PASS_TOKENS // 32
    assert PassGraphs.key(batch(32, width - 16, 16), False) is not None  # exactly at the limit
    assert PassGraphs.key(batch(32, width - 15, 16), False) is None  # one column more per row
    routed = batch(2, 4, 4)
    routed.routed_experts = torch.zeros(2, 8, 1, 1, dtype=torch.int16)
    assert PassGraphs.key(routed, False) is None


def test_likely_widths_follow_the_longest_prompt_of_a_step() -> None:
    """A step of B prompts meets the rounded width of its longest one: with 90 % of prompts at width 32 and 10 %
    at 48, a step of 8 meets 48 with probability 1 - 0.9^8 = 0.57 and 32 with 0.43; responses at every multiple up
    to max_response, longest first; a width no step is likely to meet (< 1 %) is left out."""
    lengths = [30] * 90 + [40] * 10
    assert likely_widths(lengths, prompts_per_step=8, max_response=40, multiple=16) == [
        (48, 48), (32, 48), (48, 32), (32, 32), (48, 16), (32, 16),
    ]  # fmt: skip
    # one prompt of 1000 at width 64: a step of 2 meets it with probability ~0.002
    assert likely_widths([20] * 999 + [60], prompts_per_step=2, max_response=16, multiple=16) == [(32, 16)]
    assert likely_widths([5, 9], prompts_per_step=1, max_response=3, multiple=1) == [
        (5, 3), (9, 3), (5, 2), (9, 2), (5, 1), (9, 1),
    ]  # fmt: skip  # equal chances: the narrower first
    assert likely_widths([], prompts_per_step=8, max_response=48, multiple=16) == []


@pytest.mark.parametrize("rows", [1, 4])
def test_shape_batch_makes_a_pass_of_the_widths_asked_with_masked_columns_both_sides(rows: int) -> None:
    batch = shape_batch(rows, 48, 32, vocab=100)
    sub = forward_batch(batch, torch.arange(rows), torch.device("cpu"), width_multiple=16, sides=True)
    assert PassGraphs.key(sub, False) == (rows, 48, 32, False)
    assert int(sub.input_ids.max()) < 100
    if rows > 1:  # padding on both sides, as real batches have: attention takes its masked path
        assert int(sub.attention_mask[0, 0]) == 0 and int(sub.response_mask[-1, -1]) == 0
        assert int(sub.attention_mask.sum()) == rows * 80 - 2


def test_the_role_asks_the_engine_to_prerecord_each_mini_batch_shard() -> None:
    """TrainerRole.prerecord hands the engine the training prompts' lengths and, per distinct mini-batch size, its
    rows and micro-batches (a recording stand-in engine: the real recording needs CUDA, test_gpu_cuda_graphs)."""
    raw = {"name": "t", "model": {"path": "unused", "dtype": "float32"},
           "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]},
           "trainer": {"cuda_graphs": True, "micro_batch_size": 8}, "rollout": {"n": 4},
           "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 6, "mini_batch_size": 3},
           "cluster": {"device": "cuda"}}  # fmt: skip
    calls: list[tuple[list[int], list[tuple[int, int]]]] = []

    class Recording:
        def prerecord(self, lengths: list[int], passes: list[tuple[int, int]]) -> int:
            calls.append((lengths, passes))
            return len(passes)

    def factory() -> TrainEngine:
        return cast(TrainEngine, Recording())

    role = TrainerRole(Recipe.model_validate(raw), "unused", engine_factory=factory, prompt_lengths=[7, 9])
    assert calls == [([7, 9], [(12, 2)])]  # 24 rollouts in 2 mini-batches of 12, each in 2 micro-batches
    off = Recipe.model_validate({**raw, "trainer": {"micro_batch_size": 8}})
    assert TrainerRole(off, "unused", engine_factory=factory).prerecord([7]) == 0
    assert len(calls) == 1
    assert role.prerecord([7]) == 1
