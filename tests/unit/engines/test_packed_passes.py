"""Packed passes (trainer.packed_passes, rlbridge/engines/hf/varlen.py): each pass's rows as one row of real tokens
with variable-length attention, against the padded passes, on a tiny Llama (CPU, where the attention is one causal
SDPA per row).

The batch: test_shared_prompts' 12 rows (prompts of 1-14 tokens, responses of 1-17, left-padded prompts), 3
micro-batches or a token budget. float32: log-probs atol 1e-5, losses 1e-6, gradients 1e-5 relative (Frobenius and
largest entry); with the models cast to float64, gradients within 1e-6: the same computation up to rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.algo.objective import make_loss_fn
from rlbridge.batch import SeqBatch
from rlbridge.engines.hf import varlen
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.engines.hf.varlen import VARLEN_ATTENTION, shared_layout
from rlbridge.engines.micro import budget_rows
from rlbridge.recipe.checks import run_checks
from tests.unit.engines.test_padding_free import perturb_lora_b, policy_inputs
from tests.unit.engines.test_shared_prompts import (
    NUM_MICRO,
    assert_layouts_agree,
    grouped_batch,
    grouped_lists,
    model_dir,
    recipe,
)

__all__ = ["model_dir"]  # the module-scoped fixture, shared


@pytest.mark.parametrize(
    ("algorithm", "max_tokens", "sharing"),
    [
        ({"name": "grpo", "loss_agg": "token-mean", "entropy_coef": 0.01}, None, "never"),
        ({"name": "grpo", "loss_agg": "seq-mean-token-mean", "kl": {"coef": 0.1}}, 40, "never"),
        ({"name": "grpo", "loss_agg": "token-mean", "entropy_coef": 0.01}, None, "always"),
        ({"name": "grpo", "loss_agg": "seq-mean-token-mean", "kl": {"coef": 0.1}}, 40, "always"),
    ],
    ids=[
        "token-mean+entropy",
        "seq-mean+kl+budget",
        "shared+token-mean+entropy",
        "shared+seq-mean+kl+budget",
    ],
)
def test_packed_passes_give_the_padded_log_probs_loss_and_gradients(
    model_dir: Path, algorithm: dict[str, Any], max_tokens: int | None, sharing: str
) -> None:
    packed = HFTrainEngine(
        recipe(model_dir, sharing, algorithm, max_tokens_per_micro_batch=max_tokens, packed_passes=True),
        model_dir,
    )
    padded = HFTrainEngine(
        recipe(model_dir, "never", algorithm, max_tokens_per_micro_batch=max_tokens), model_dir
    )
    assert packed.hf_model.config._attn_implementation == VARLEN_ATTENTION
    batch = grouped_batch()
    assert_layouts_agree(packed, padded, batch)
    assert float((packed.logprobs(batch) * (1 - batch.response_mask)).abs().max()) == 0.0  # 0 on padding


def test_packed_passes_train_a_step_as_the_padded_ones(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = [0]
    rows_attention = varlen._rows_attention

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return rows_attention(*args)

    monkeypatch.setattr(varlen, "_rows_attention", counted)
    algorithm = {"name": "grpo"}
    packed = HFTrainEngine(recipe(model_dir, "never", algorithm, packed_passes=True), model_dir)
    padded = HFTrainEngine(recipe(model_dir, "never", algorithm), model_dir)
    perturb_lora_b(packed.trainable_state(), packed.load_trainable_state)
    padded.load_trainable_state(packed.trainable_state())
    batch = grouped_batch()
    old = padded.logprobs(batch)
    fn = make_loss_fn(
        packed.recipe.algorithm,
        policy_inputs(batch, old, old),
        norm_constant=32.0,
        micro_scale=float(NUM_MICRO),
    )
    for engine in (packed, padded):
        assert engine.train_step(batch, fn, num_micro_batches=NUM_MICRO)["skipped"] == 0.0
    layers = packed.hf_model.config.num_hidden_layers
    assert calls[0] == layers * NUM_MICRO  # every layer of every training pass ran the packed attention
    for name, want in padded.trainable_state().items():
        torch.testing.assert_close(packed.trainable_state()[name], want, atol=1e-6, rtol=1e-5)


def test_validate_refuses_what_packed_passes_cannot_carry(model_dir: Path) -> None:
    base = recipe(model_dir, "never", {"name": "grpo"}, packed_passes=True)
    assert not [i for i in run_checks(base, model_checks=False)[0] if i.key == "trainer.packed_passes"]
    for update, fragment in (
        ({"cuda_graphs": True}, "trainer.cuda_graphs: false"),
        ({"engine": "megatron"}, "trainer.engine: hf"),
    ):
        r = base.model_copy(update={"trainer": base.trainer.model_copy(update=update)})
        issues = [i for i in run_checks(r, model_checks=False)[0] if i.key == "trainer.packed_passes"]
        assert issues and any(fragment in i.fix for i in issues), (update, issues)
    # shared prompts in packed passes need no KV cache: recompute is fine
    recompute = base.trainer.recompute.model_copy(update={"granularity": "full"})
    shared = base.model_copy(
        update={
            "trainer": base.trainer.model_copy(update={"shared_prompts": "always", "recompute": recompute})
        }
    )
    keys = {i.key for i in run_checks(shared, model_checks=False)[0]}
    assert not keys & {"trainer.packed_passes", "trainer.shared_prompts"}, keys
    padded = shared.model_copy(update={"trainer": shared.trainer.model_copy(update={"packed_passes": False})})
    assert "trainer.shared_prompts" in {i.key for i in run_checks(padded, model_checks=False)[0]}


def test_the_shared_layout_runs_each_prompt_once() -> None:
    batch = grouped_batch()
    prompts, responses = grouped_lists()
    layout = shared_layout(batch)
    distinct = {tuple(p): None for p in prompts}  # in order of their first row, as prompt_index numbers them
    want_ids = [t for p in distinct for t in p] + [t for r in responses for t in r]
    assert layout.input_ids.tolist() == want_ids
    n_prompt = sum(len(p) for p in distinct)
    starts = dict(
        zip(distinct, torch.tensor([0] + [len(p) for p in distinct]).cumsum(0).tolist(), strict=False)
    )
    # a row's keys: its prompt's tokens, then its own response's; its first token is predicted by its prompt's last
    keys, picks, at = [], [], n_prompt
    for p, r in zip(prompts, responses, strict=True):
        own = list(range(starts[tuple(p)], starts[tuple(p)] + len(p)))
        keys += own + list(range(at, at + len(r)))
        picks += [own[-1]] + list(range(at, at + len(r) - 1))
        at += len(r)
    prompt_keys = list(range(n_prompt))
    assert layout.kv_index.tolist() == prompt_keys + keys
    assert layout.picks.tolist() == picks
    assert layout.cu_q[-1] == len(want_ids) and layout.cu_k[-1] == len(prompt_keys + keys)
    assert layout.longest_k == max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    # positions: a prompt from 0, a response from its prompt's length
    want_pos = [i for p in distinct for i in range(len(p))]
    want_pos += [len(p) + i for p, r in zip(prompts, responses, strict=True) for i in range(len(r))]
    assert layout.position_ids.tolist() == want_pos


def test_one_token_responses_in_shared_packed_passes(model_dir: Path) -> None:
    engine = HFTrainEngine(recipe(model_dir, "always", {"name": "grpo"}, packed_passes=True), model_dir)
    plain = HFTrainEngine(recipe(model_dir, "never", {"name": "grpo"}), model_dir)
    batch = SeqBatch.from_token_lists([[3, 4, 5]] * 3 + [[9]] * 2, [[7], [8], [9], [1], [2]], pad_id=256)
    torch.testing.assert_close(engine.logprobs(batch), plain.logprobs(batch), atol=1e-5, rtol=0)


def test_a_packed_budget_counts_real_tokens() -> None:
    batch = grouped_batch()
    real = batch.attention_mask.sum(dim=1)
    padded = budget_rows(batch, 40)
    packed = budget_rows(batch, 40, packed=True)
    assert sorted(torch.cat(packed).tolist()) == list(range(batch.size))
    assert all(int(real[g].sum()) <= 40 or len(g) == 1 for g in packed)
    assert len(packed) < len(padded)  # the padding the padded passes count leaves fewer rows per pass


def test_a_model_with_sliding_window_layers_is_refused_by_the_engine_too() -> None:
    """validate-recipe refuses it first (recipe/checks/model.py); the engine's own guard names the layers."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from rlbridge.errors import RlbridgeError

    config = Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
    )  # fmt: skip
    with pytest.raises(RlbridgeError, match="1 sliding-window attention layers.*packed_passes: false"):
        varlen.use_packed_attention(Gemma3ForCausalLM(config))
