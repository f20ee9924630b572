"""Fast checks of the megatron engine's pure parts (no megatron import)."""

from __future__ import annotations

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.engines.megatron.forward import attention_mask, split_micro_batches
from rlbridge.engines.megatron.params import ParamSets, check_param_sets
from rlbridge.errors import RlbridgeError


def _sets(**override: frozenset[str]) -> ParamSets:
    adapters = frozenset({"a.adapter.linear_in.weight", "a.adapter.linear_out.weight"})
    base = dict(
        at_wrap=adapters, trainable=adapters, optimizer=adapters, grad_buffers=adapters, adapters=adapters
    )
    return ParamSets(**{**base, **override})


def test_param_sets_must_agree() -> None:
    check_param_sets(_sets())
    with pytest.raises(RlbridgeError, match="optimizer: missing"):
        check_param_sets(_sets(optimizer=frozenset({"a.adapter.linear_in.weight"})))
    with pytest.raises(RlbridgeError, match="unexpected"):
        extra = frozenset({"a.adapter.linear_in.weight", "a.adapter.linear_out.weight", "a.to_wrap.weight"})
        check_param_sets(_sets(grad_buffers=extra))
    with pytest.raises(RlbridgeError, match="nothing to train"):
        empty = frozenset[str]()
        check_param_sets(ParamSets(empty, empty, empty, empty, empty))


def test_attention_mask_blocks_future_and_padding() -> None:
    valid = torch.tensor([[0, 1, 1], [1, 1, 1]])
    mask = attention_mask(valid)  # True = not allowed
    assert mask.shape == (2, 1, 3, 3)
    assert bool(mask[0, 0, 2, 0]) and not bool(mask[0, 0, 2, 1]) and bool(mask[1, 0, 0, 1])


def test_micro_batches_follow_tensor_split_and_pad_for_pipelines() -> None:
    batch = SeqBatch.from_token_lists([[1], [2, 3], [4], [5], [6]], [[7], [8], [9, 9], [1], [2]], pad_id=0)
    plain = split_micro_batches(batch, 2)
    assert [len(mb.rows) for mb in plain] == [3, 2] and [mb.input_ids.shape[0] for mb in plain] == [3, 2]
    piped = split_micro_batches(batch, 2, equal_rows=True, count_multiple=4, seq_multiple=4)
    assert [mb.rows.tolist() for mb in piped] == [[0, 1, 2], [3, 4], [], []]
    assert {mb.input_ids.shape for mb in piped} == {(3, 4)}


def test_rope_theta_moved_by_transformers5_is_put_back() -> None:
    """transformers 5 keeps rope_theta in rope_parameters; Megatron-Bridge 0.3 read only the attribute and
    silently used base 10000 (found by `rlbridge train --smoke` on the Qwen2.5-7B recipe: theta 1e6)."""
    from types import SimpleNamespace

    from rlbridge.engines.megatron.provider import restore_rope_fields

    cfg = SimpleNamespace(rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    assert restore_rope_fields(cfg) == 1e6 and cfg.rope_theta == 1e6 and not hasattr(cfg, "rope_scaling")
    yarn = {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}
    cfg = SimpleNamespace(rope_parameters=yarn, rope_scaling=None)
    assert restore_rope_fields(cfg) == 1e4 and cfg.rope_scaling == yarn
    assert restore_rope_fields(SimpleNamespace(rope_theta=5e5)) == 5e5
