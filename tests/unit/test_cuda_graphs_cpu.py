"""trainer.cuda_graphs without a GPU: what can be checked on a CPU (the recording itself runs in
tests/gpu/test_gpu_cuda_graphs.py). An engine asked for graphs off CUDA refuses with the key's name; which passes
get recorded (PassGraphs.key): small enough, no replayed experts, one key per (rows, P, R, entropy gradient)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.engines.graphs import PassGraphs
from rlbridge.engines.hf import HFTrainEngine
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import MAX_PASS_TOKENS, Recipe
from tests.fixtures.tiny_llama import build_tiny_llama


def test_an_engine_off_cuda_refuses_graphs_by_name(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path)
    raw = {"name": "t", "model": {"path": str(model), "dtype": "float32"},
           "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]}, "trainer": {"cuda_graphs": True},
           "rollout": {"n": 2}, "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 2},
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
