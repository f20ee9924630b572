"""Fast checks of the megatron engine's pure parts (no megatron import)."""

from __future__ import annotations

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.engines.megatron.forward import attention_mask, nominal_scale, split_micro_batches
from rlbridge.engines.megatron.params import ParamSets, check_param_sets
from rlbridge.engines.micro import budget_rows
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


def test_length_grouped_micro_batches_are_trimmed_then_padded_for_sequence_parallelism() -> None:
    """by_length: rows grouped by length, each micro-batch at its rows' own widths, the sequence padded to a
    multiple of TP (sequence parallelism) after the trim; replayed experts stay on their columns."""
    prompts, responses = [[1], [2, 3, 4, 5, 6], [4], [5, 6]], [[7, 7, 7, 7, 7, 7], [8], [9, 9], [1]]
    full = SeqBatch.from_token_lists(prompts, responses, pad_id=0)  # [4, 5 + 6]
    routed = full.input_ids[:, :, None, None].to(torch.int16).expand(-1, -1, 2, 2).clone()
    batch = SeqBatch(full.input_ids, full.attention_mask, full.position_ids, full.response_mask,
                     full.prompt_width, routed_experts=routed)  # fmt: skip
    mbs = split_micro_batches(batch, 2, seq_multiple=4, by_length=True)
    assert [mb.rows.tolist() for mb in mbs] == [[3, 1], [2, 0]]  # by response, then prompt length
    assert [(mb.prompt_width, mb.response_width) for mb in mbs] == [(5, 1), (1, 6)]
    assert [mb.input_ids.shape[1] for mb in mbs] == [8, 8]  # 6 and 7 columns, padded to multiples of 4
    for mb in mbs:
        p, r, n = mb.prompt_width, mb.response_width, len(mb.rows)
        sub = batch.select(mb.rows).trimmed()
        assert torch.equal(mb.input_ids[:, : p + r], sub.input_ids)
        assert bool(mb.attention_mask[:, 0, :, p + r :].all())  # the added columns are masked keys
        assert mb.routed_experts is not None and mb.routed_experts.shape[:2] == mb.input_ids.shape
        assert torch.equal(mb.routed_experts[:n, : p + r, 1, 0], sub.input_ids.to(torch.int16))
    with pytest.raises(ValueError, match="pipeline"):
        split_micro_batches(batch, 2, equal_rows=True, by_length=True)


def test_token_budget_forms_the_micro_batches_where_rows_are_grouped_by_length() -> None:
    """max_tokens: budget_rows' groups (the hf engine's) at their own widths, however many; ignored for the
    index-order layout (pipeline or context parallelism, where validation refuses the budget)."""
    prompts, responses = [[1], [2, 3, 4, 5, 6], [4], [5, 6]], [[7, 7, 7, 7, 7, 7], [8], [9, 9], [1]]
    batch = SeqBatch.from_token_lists(prompts, responses, pad_id=0)
    mbs = split_micro_batches(batch, 2, by_length=True, max_tokens=8)
    assert (
        [mb.rows.tolist() for mb in mbs]
        == [g.tolist() for g in budget_rows(batch, 8)]
        == [[3], [1], [2], [0]]
    )
    assert [mb.input_ids.shape[1] for mb in mbs] == [3, 6, 3, 7]
    plain = split_micro_batches(batch, 2, max_tokens=8)
    assert [mb.rows.tolist() for mb in plain] == [[0, 1], [2, 3]]
    # megatron-core divides each pass's loss by the passes run: 4 x (4 / 2) / 4 = the nominal / 2 each
    assert nominal_scale(len(mbs), 2) == 2.0 and nominal_scale(3, 3) == 1.0


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
