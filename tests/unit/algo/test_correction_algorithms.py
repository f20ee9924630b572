"""algorithm.rollout_correction with every algorithm, on the real hf engine (tiny Llama, LoRA, float32, CPU).

Rollout log-probs are the trainer's plus seeded noise (std 0.8 nats), so weights spread over the clamp, the band
and the rejection threshold. On policy the PPO ratio is 1, where the clipped surrogate is linear in the
advantage: the corrected gradient must equal the uncorrected gradient with advantages multiplied by the
test_correction loop reference's factor (a masked token = a zero advantage). Tolerance rel 1e-4 / abs 1e-7 of
float32 gradients (only the order of one multiplication differs; measured 1e-6). PPO's critic must not see the
correction at all: its weights after an update are bit-for-bit those without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.algo import correction as C
from rlbridge.algo.objective import LossInputs, make_loss_fn
from rlbridge.batch import SeqBatch
from rlbridge.recipe.schema import Recipe
from rlbridge.trainer.role import TrainerRole
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.unit.algo.test_correction import ref_factor

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
RESPONSES = [[10, 11, 30, 31], [12, 13, 14], [15, 40, 41, 42, 43], [16, 17]]
CORRECTION = {
    "weights": "token",
    "clamp_high": 2.0,
    "mask_band": [0.3, 3.0],
    "reject": {"divergence": "k3", "level": "token", "threshold": 0.6},
}
ALGORITHMS: list[dict[str, Any]] = [
    {"name": "grpo"},
    {"name": "dr_grpo"},
    {"name": "dapo"},
    {"name": "gspo"},
    {"name": "rloo"},
    {"name": "reinforce_pp"},
    {"name": "ppo", "critic": {"lr": 1e-2}},
    {
        "name": "grpo",
        "kl": {"coef": 0.1, "where": "loss"},
        "entropy_coef": 0.01,
        "rollout_correction": {"weights": "sequence"},
    },
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def recipe(model_dir: Path, algorithm: dict[str, Any], **data: Any) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 4, "targets": ["all-linear"]},
            "trainer": {"micro_batch_size": 2, "optim": {"lr": 1e-2}},
            "rollout": {"n": 2, "max_response_tokens": 8},
            "algorithm": algorithm,
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 2, **data},
            "cluster": {"device": "cpu"},
        }
    )


def inputs(t: TrainerRole) -> tuple[SeqBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    b = SeqBatch.from_token_lists(PROMPTS, RESPONSES, pad_id=256)
    g = torch.Generator().manual_seed(0)
    lp = t.logprobs(b)
    rollout = torch.where(b.response_mask > 0, lp + 0.8 * torch.randn(lp.shape, generator=g), 0.0)
    adv = torch.randn(lp.shape, generator=g) * b.response_mask
    return b, lp, rollout, adv


def _name(a: dict[str, Any]) -> str:
    return a["name"] + ("-kl-entropy-sequence" if "kl" in a else "")


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=_name)
def test_corrected_gradient_is_the_gradient_of_reweighted_advantages(
    model_dir: Path, algorithm: dict[str, Any]
) -> None:
    corrected = {**algorithm, "rollout_correction": algorithm.get("rollout_correction", CORRECTION)}
    r_on, r_off = (
        recipe(model_dir, corrected),
        recipe(model_dir, {k: v for k, v in algorithm.items() if k != "rollout_correction"}),
    )
    t = TrainerRole(r_on, str(model_dir))
    b, lp, rollout, adv = inputs(t)
    factor = torch.tensor(
        ref_factor(
            r_on.algorithm.rollout_correction, lp.tolist(), rollout.tolist(), b.response_mask.int().tolist()
        ),
        dtype=torch.float32,
    )
    valid = b.response_mask > 0
    assert bool((factor[valid] > 1).any()) and bool(((factor > 0) & (factor < 1)).any())
    if (
        r_on.algorithm.rollout_correction.mask_band is not None
    ):  # some tokens masked, some truncated, most kept
        assert 0 < int((factor[valid] == 0).sum()) < int(valid.sum()) // 2 and bool((factor == 2.0).any())
    norm = float(r_on.rollout.max_response_tokens)
    with_rc = make_loss_fn(
        r_on.algorithm, LossInputs(adv, b.response_mask, None, None, rollout), norm_constant=norm
    )
    reweighted = make_loss_fn(
        r_off.algorithm, LossInputs(adv * factor, b.response_mask, None, None, rollout), norm_constant=norm
    )
    if algorithm.get(
        "kl"
    ):  # the KL term is not weighted: compare the policy terms alone (reference = the model itself)
        ref = t.logprobs(b, reference=True)
        with_rc = make_loss_fn(
            r_on.algorithm, LossInputs(adv, b.response_mask, None, ref, rollout), norm_constant=norm
        )
        reweighted = make_loss_fn(
            r_off.algorithm, LossInputs(adv * factor, b.response_mask, None, ref, rollout), norm_constant=norm
        )
    got = t.engine.gradients(b, with_rc, num_micro_batches=2)  # type: ignore[attr-defined]
    want = t.engine.gradients(b, reweighted, num_micro_batches=2)  # type: ignore[attr-defined]
    plain = t.engine.gradients(
        b,
        make_loss_fn(
            r_off.algorithm,
            LossInputs(adv, b.response_mask, None, None, rollout),  # type: ignore[attr-defined]
            norm_constant=norm,
        ),
        num_micro_batches=2,
    )
    # `factor` comes from t.logprobs (no-gradient chunks), the closure's weights from the training passes: with
    # passes at their rows' own widths (engines/micro.py) the two log-probs differ in float32 rounding, so the
    # absolute tolerance is 1e-6 of the tensor's largest entry (measured: 5e-7; 7e-7 with full-width passes)
    for name, g in got.items():
        w = want[name]
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * float(w.abs().max()), msg=name)
    moved = sum(float((got[n] - plain[n]).norm()) for n in got) / sum(float(plain[n].norm()) for n in got)
    assert moved > 0.05, moved  # negative control: the correction changes the gradient


@pytest.mark.parametrize("algorithm", ALGORITHMS[:1] + ALGORITHMS[6:7], ids=_name)
def test_update_reports_exact_step_metrics(model_dir: Path, algorithm: dict[str, Any]) -> None:
    """The update's rc_* metrics are those of the whole step (the recorder's live log-probs of the pre-update
    weights), not micro-batch means: equal to correction.metrics on the full batch, rel 1e-5."""
    r = recipe(model_dir, {**algorithm, "rollout_correction": CORRECTION})
    t = TrainerRole(r, str(model_dir))
    b, lp, rollout, adv = inputs(t)
    extra = (t.values(b), torch.zeros_like(lp)) if t.critic is not None else ()
    m = t.update(b, adv, rollout, None, *extra)
    want = C.metrics(r.algorithm.rollout_correction, lp, rollout, b.response_mask)
    for key, value in want.items():
        assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert m["old_logprobs_s"] == 0.0  # on policy: no forward before the update
    assert 0 < m["trainer_update_s"] < 60  # the trainer's own seconds, inside the loop's time_update
    assert 0 < m["train_steps_s"] <= m["trainer_update_s"]  # the engines' train steps, inside it
    assert "release_s" not in m  # no vLLM to hand memory to (CPU)


def test_ppo_critic_does_not_see_the_correction(model_dir: Path) -> None:
    states = []
    for rc in ({}, CORRECTION):
        torch.manual_seed(0)
        t = TrainerRole(
            recipe(model_dir, {"name": "ppo", "critic": {"lr": 1e-2}, "rollout_correction": rc}),
            str(model_dir),
        )
        b, lp, rollout, adv = inputs(t)
        old_values = t.values(b)
        t.update(b, adv, rollout, None, old_values, torch.where(b.response_mask > 0, 1.0, 0.0))
        assert t.critic is not None
        states.append((t.critic.trainable_state(), t.engine.trainable_state()))
    (critic_a, policy_a), (critic_b, policy_b) = states
    assert all(torch.equal(critic_a[k], critic_b[k]) for k in critic_a)
    assert not all(torch.equal(policy_a[k], policy_b[k]) for k in policy_a)


class CountingLogprobs:
    def __init__(self, t: TrainerRole) -> None:
        self.calls = 0
        self.inner = t.engine.logprobs
        t.engine.logprobs = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("bypass", [False, True])
def test_bypass_takes_old_logprobs_from_the_rollout(model_dir: Path, bypass: bool) -> None:
    """Two mini-batches: without bypass one forward computes the old log-probs; with it none does, and the first
    mini-batch's PPO ratio is pi_trainer / pi_rollout (its mean: exp(lp - rollout) over the valid tokens)."""
    r = recipe(model_dir, {"name": "grpo", "rollout_correction": {"bypass": bypass}}, mini_batch_size=1)
    t = TrainerRole(r, str(model_dir))
    b, lp, rollout, adv = inputs(t)
    counter = CountingLogprobs(t)
    seen: list[dict[str, float]] = []
    mini = t._update_mini
    t._update_mini = lambda *a, **k: seen.append(mini(*a, **k)) or seen[-1]  # type: ignore[method-assign]
    m = t.update(b, adv, rollout, None)
    assert counter.calls == (0 if bypass else 1)
    assert (m["old_logprobs_s"] == 0.0) == bypass
    first = torch.arange(2)
    valid = b.response_mask[first] > 0
    want = torch.exp(lp[first] - rollout[first])[valid].mean() if bypass else torch.tensor(1.0)
    assert seen[0]["ratio_mean"] == pytest.approx(float(want), rel=1e-5)
    assert (
        m["logprob_diff_mean"] > 0.1
    )  # measured against the trainer, never against itself (bypass: old == rollout)
