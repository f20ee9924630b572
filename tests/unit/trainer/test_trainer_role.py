"""TrainerRole on the real hf engine (tiny Llama, LoRA): the health gates fire on the faults they guard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.recipe.schema import Recipe
from rlbridge.trainer.gate import HealthError
from rlbridge.trainer.role import TrainerRole
from tests.fixtures.tiny_llama import build_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def role(model_dir: Path, **health: object) -> TrainerRole:
    r = Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 4, "targets": ["linear_qkv"]},
            "trainer": {"micro_batch_size": 2, "optim": {"lr": 1e-2}},
            "rollout": {"n": 2},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 2},
            "run": {"health": health},
            "cluster": {"device": "cpu"},
        }
    )
    return TrainerRole(r, str(model_dir))


def batch() -> tuple[SeqBatch, torch.Tensor, torch.Tensor]:
    b = SeqBatch.from_token_lists(
        [[1, 2, 3], [4, 5], [6, 7, 8], [9]], [[10, 11], [12, 13, 14], [15], [16, 17]], pad_id=256
    )
    adv = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(4, b.response_width) * b.response_mask
    return b, adv, torch.zeros_like(adv)


def test_gates_pass_on_a_healthy_run(model_dir: Path) -> None:
    t = role(model_dir)
    b, adv, lp = batch()
    for _ in range(2):
        lp = t.logprobs(b)
        m = t.update(b, adv, lp, None)
        assert (
            m["grad_norm"] > 0 and m["logprob_diff_max"] < 1e-5
        )  # on-policy: trainer == the given log-probs
    assert t.gate.done


def test_no_signal_defers_the_gate(model_dir: Path) -> None:
    """Updates without signal (all-equal rewards) do not count: LoRA's A only moves from the 2nd signal on."""
    t = role(model_dir)
    b, adv, lp = batch()
    for a in (adv * 0, adv * 0, adv):
        t.update(b, a, lp, None)
        assert not t.gate.done
    t.update(b, adv, lp, None)
    assert t.gate.done


def test_zero_gradients_stop_the_run(model_dir: Path) -> None:
    t = role(model_dir)
    for _, p in t.engine.model.named_parameters():  # type: ignore[attr-defined]
        if p.requires_grad:
            p.register_hook(
                lambda g: torch.zeros_like(g)
            )  # the silent "grad_norm = 0" bug of LoRA + recompute
    b, adv, lp = batch()
    with pytest.raises(HealthError, match="grad_norm is 0"):
        t.update(b, adv, lp, None)


def test_a_frozen_tensor_that_moves_stops_the_run(model_dir: Path) -> None:
    t = role(model_dir)
    b, adv, lp = batch()
    t.update(b, adv, lp, None)
    with torch.no_grad():
        t.engine.hf_model.model.layers[0].mlp.down_proj.weight.add_(1.0)  # type: ignore[attr-defined]
    with pytest.raises(HealthError, match="frozen tensors changed"):
        t.update(b, adv, lp, None)


def test_gate_can_be_turned_off(model_dir: Path) -> None:
    t = role(model_dir, first_step=False)
    for _, p in t.engine.model.named_parameters():  # type: ignore[attr-defined]
        if p.requires_grad:
            p.register_hook(lambda g: torch.zeros_like(g))
    b, adv, lp = batch()
    assert t.update(b, adv, lp, None)["grad_norm"] == 0


def test_a_batch_short_of_batch_size_times_n_still_trains(model_dir: Path) -> None:
    """DAPO's dynamic sampling can hand over fewer rows than batch_size * n: one mini-batch, not zero."""
    t = role(model_dir)
    b, adv, _ = batch()
    rows = torch.tensor([0, 1, 2])
    before = {k: v.clone() for k, v in t.engine.trainable_state().items()}
    m = t.update(b.select(rows), adv[rows], t.logprobs(b.select(rows)), None)
    assert m["grad_norm"] > 0 and t.updates == 1
    assert any(not torch.equal(v, before[k]) for k, v in t.engine.trainable_state().items())
