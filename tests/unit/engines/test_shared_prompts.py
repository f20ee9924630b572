"""Shared prompts (rlbridge/engines/hf/shared_prompts.py): passes that run each distinct prompt once and its
responses against the prompt's cached keys and values, against the plain passes (trainer.shared_prompts never),
on a tiny Llama (CPU).

The batch: 4 prompts of 1-14 tokens, 3 responses each of 1-17 tokens, rows interleaved (a prompt's rows are
not adjacent), 3 micro-batches of 4 rows (so one prompt's rows are split over two passes). float32: log-probs
atol 1e-5, losses rel/abs 1e-6, gradients 1e-5 relative (Frobenius and largest entry); with the model cast to
float64, gradients within 1e-6 (logits, losses and token statistics stay float32): the differences are
rounding, not a different computation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.algo.objective import make_loss_fn
from rlbridge.batch import SeqBatch
from rlbridge.engines.hf import shared_prompts
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.recipe.schema import Recipe
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.unit.engines.test_padding_free import assert_grads_close, perturb_lora_b, policy_inputs, summed

torch.set_num_threads(2)
NUM_MICRO = 3
PROMPT_LENS = [14, 1, 6, 9]
RESPONSE_LENS = [[17, 2, 5], [1, 9, 16], [3, 3, 12], [7, 1, 2]]


def grouped_lists() -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    rows = [(p, torch.randint(0, 256, (n,), generator=gen).tolist()) for p, lens in enumerate(RESPONSE_LENS)
            for n in lens]  # fmt: skip
    rows = rows[0::3] + rows[1::3] + rows[2::3]  # prompt 0, 1, 2, 3, 0, 1, ...: a prompt's rows are apart
    return [prompts[p] for p, _ in rows], [r for _, r in rows]


def grouped_batch() -> SeqBatch:
    return SeqBatch.from_token_lists(*grouped_lists(), pad_id=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def recipe(model_dir: Path, mode: str, algorithm: dict[str, Any], **trainer: Any) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]},
            "trainer": {"logprob_chunk_size": 5, "optim": {"lr": 1e-2}, "shared_prompts": mode, **trainer},
            "rollout": {"n": 3, "max_response_tokens": 32},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
            "algorithm": algorithm,
            "cluster": {"device": "cpu"},
        }
    )


def test_prompt_index_finds_the_rows_of_each_prompt() -> None:
    batch = grouped_batch()
    first, prompt_of = shared_prompts.prompt_index(batch)
    assert first.tolist() == [0, 1, 2, 3] and prompt_of.tolist() == [0, 1, 2, 3] * 3
    # same tokens at another length are another prompt; left padding does not make prompts equal
    other = SeqBatch.from_token_lists([[5, 6], [6], [5, 6], [7, 6]], [[1], [1], [2], [3]], pad_id=0)
    assert shared_prompts.prompt_index(other)[1].tolist() == [0, 1, 0, 2]


def test_grouped_rows_keep_prompts_together_and_fit_the_budget() -> None:
    batch = grouped_batch()
    for groups in (shared_prompts.grouped_rows(batch, 4), shared_prompts.grouped_rows(batch, 2)):
        assert sorted(torch.cat(groups).tolist()) == list(range(batch.size))
        prompt_of = shared_prompts.prompt_index(batch)[1]
        assert all(len({int(prompt_of[r]) for r in g}) == 12 // len(groups) // 3 for g in groups)
    prompt_len, response_len = shared_prompts.widths(batch)
    prompt_of = shared_prompts.prompt_index(batch)[1]
    for budget in (1, 30, 60, 1000):
        for packed in (False, True):
            groups = shared_prompts.grouped_rows(batch, 1, max_tokens=budget, packed=packed)
            assert sorted(torch.cat(groups).tolist()) == list(range(batch.size))
            rows = [g.tolist() for g in groups]
            for i, g in enumerate(
                rows
            ):  # each group fits (or is one row), and its next row would not have fit
                cost = shared_prompts.shared_positions(g, prompt_of, prompt_len, response_len, packed=packed)
                assert cost <= budget or len(g) == 1
                if i + 1 < len(rows):
                    more = g + rows[i + 1][:1]
                    assert (
                        shared_prompts.shared_positions(
                            more, prompt_of, prompt_len, response_len, packed=packed
                        )
                        > budget
                    )


def test_auto_shares_grouped_rows_only(model_dir: Path) -> None:
    engine = HFTrainEngine(recipe(model_dir, "auto", {"name": "grpo"}), model_dir)
    batch = grouped_batch()
    plain = [torch.arange(12).tensor_split(NUM_MICRO)[i] for i in range(NUM_MICRO)]
    assert engine._layout(batch, plain, NUM_MICRO, None)[1]
    distinct = SeqBatch.from_token_lists([[i + 1] * 5 for i in range(6)], [[1] * 4] * 6, pad_id=0)
    assert not engine._layout(distinct, list(torch.arange(6).tensor_split(2)), 2, None)[1]
    engine.device = torch.device("cuda")  # _layout only reads the type: auto keeps a GPU on the plain passes
    assert not engine._layout(batch, plain, NUM_MICRO, None)[1]
    never = HFTrainEngine(recipe(model_dir, "never", {"name": "grpo"}), model_dir)
    assert not never._layout(batch, plain, NUM_MICRO, None)[1]
    recompute = recipe(model_dir, "always", {"name": "grpo"}, recompute={"granularity": "full"})
    assert not HFTrainEngine(recompute, model_dir)._layout(batch, plain, NUM_MICRO, None)[1]


@pytest.mark.parametrize(
    ("algorithm", "max_tokens"),
    [
        ({"name": "grpo", "loss_agg": "token-mean", "entropy_coef": 0.01}, None),
        ({"name": "grpo", "loss_agg": "seq-mean-token-mean", "kl": {"coef": 0.1}}, None),
        ({"name": "dr_grpo"}, 40),  # a token budget: passes by the shared layout's positions
    ],
    ids=["token-mean+entropy", "seq-mean+kl", "dr_grpo+budget"],
)
def test_shared_prompts_give_the_plain_log_probs_loss_and_gradients(
    model_dir: Path, algorithm: dict[str, Any], max_tokens: int | None
) -> None:
    shared = HFTrainEngine(
        recipe(model_dir, "always", algorithm, max_tokens_per_micro_batch=max_tokens), model_dir
    )
    plain = HFTrainEngine(
        recipe(model_dir, "never", algorithm, max_tokens_per_micro_batch=max_tokens), model_dir
    )
    assert_layouts_agree(shared, plain, grouped_batch())


def assert_layouts_agree(got: HFTrainEngine, want: HFTrainEngine, batch: SeqBatch) -> None:
    """Two engines of one recipe but their pass layout, on the same LoRA weights (`got`'s, B perturbed): the same
    log-probs and reference log-probs (atol 1e-5 + rtol 2e-6: float32 rounding of log-probs down to -10; the shared
    packed layout's differ by up to 1.14e-5 in float32 and not at all with the models in float64), then the same loss (1e-6) and gradients (assert_grads_close)
    of the recipe's algorithm in float32 (1e-5) and with both models cast to float64 (1e-6)."""
    perturb_lora_b(got.trainable_state(), got.load_trainable_state)
    want.load_trainable_state(got.trainable_state())
    old, ref = want.logprobs(batch), want.logprobs(batch, reference=True)
    torch.testing.assert_close(got.logprobs(batch), old, atol=1e-5, rtol=2e-6)
    torch.testing.assert_close(got.logprobs(batch, reference=True), ref, atol=1e-5, rtol=2e-6)
    inputs = policy_inputs(batch, old, ref)
    fn = make_loss_fn(got.recipe.algorithm, inputs, norm_constant=32.0, micro_scale=float(NUM_MICRO))
    for tol in (1e-5, 1e-6):  # float32, then the models cast to float64
        if tol < 1e-5:
            got.model.double()
            want.model.double()
        losses = [[0.0], [0.0]]
        want_grads = want.gradients(batch, summed(fn, losses[0]), num_micro_batches=NUM_MICRO)
        got_grads = got.gradients(batch, summed(fn, losses[1]), num_micro_batches=NUM_MICRO)
        assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-6, abs=1e-6) and losses[0][0] != 0.0
        assert_grads_close(got_grads, want_grads, tol)


def test_a_response_of_one_token_needs_no_response_pass(model_dir: Path) -> None:
    engine = HFTrainEngine(recipe(model_dir, "always", {"name": "grpo"}), model_dir)
    plain = HFTrainEngine(recipe(model_dir, "never", {"name": "grpo"}), model_dir)
    batch = SeqBatch.from_token_lists([[3, 4, 5]] * 3 + [[9]] * 2, [[7], [8], [9], [1], [2]], pad_id=256)
    torch.testing.assert_close(engine.logprobs(batch), plain.logprobs(batch), atol=1e-5, rtol=0)
