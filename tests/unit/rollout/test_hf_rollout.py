"""HFRollout on a tiny random Llama: raw-model log-probs, greedy parity with transformers, grouping and
finish reasons, merged and adapter weight sync, version checks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.recipe.schema import ModelCfg, RolloutCfg
from rlbridge.rollout.base import SamplingCfg, StaleWeightsError
from rlbridge.rollout.hf import HFRollout
from rlbridge.weights import WeightExport
from tests.fixtures.tiny_llama import (
    EOS_ID,
    build_tiny_llama,
    load_tiny_llama,
    lora_export,
    max_logprob_diff,
    perturbed_state,
)

PROMPTS = [[257, 259, 72, 105, 10], [257, 259, 50, 43, 50, 61, 63, 10, 259], [257, 65]]
SAMPLE = SamplingCfg(n=4, temperature=0.7, top_p=0.9, top_k=50, max_tokens=24)
GREEDY = SamplingCfg(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=16, greedy=True)
TOL = 5e-5  # float32 engine vs float32 reference forward (seen: <= 7.4e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def make_rollout(model_dir: Path, seed: int = 0) -> HFRollout:
    cfg = RolloutCfg(engine="hf", max_prompt_tokens=32, max_response_tokens=64)
    return HFRollout(model_dir, cfg, ModelCfg(path=str(model_dir), dtype="float32"), seed=seed)


def assert_logprobs_match(model: Any, rollouts: Any) -> None:
    worst = max_logprob_diff(model, rollouts)
    assert worst < TOL, f"max |rollout - forward| log-prob {worst:.2e}"


def test_sampled_logprobs_are_raw_model_logprobs(model_dir: Path) -> None:
    out = make_rollout(model_dir).generate(PROMPTS, SAMPLE, expect_version=0)
    # temperature 0.7 / top-p / top-k shape the sampling, not the log-probs: those are the raw model's
    assert_logprobs_match(load_tiny_llama(model_dir), out)
    assert out.weight_version == 0


def test_groups_are_contiguous_and_finish_reasons_right(model_dir: Path) -> None:
    sampling = SamplingCfg(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=48)
    out = make_rollout(model_dir).generate(PROMPTS, sampling, expect_version=0)
    assert len(out) == 24 and len(out.texts) == 24
    assert out.prompt_ids == [p for p in PROMPTS for _ in range(8)]
    for response, reason in zip(out.response_ids, out.finish_reasons, strict=True):
        if reason == "stop":
            assert response[-1] == EOS_ID and EOS_ID not in response[:-1]
        else:
            assert reason == "length" and len(response) == 48 and EOS_ID not in response
    assert set(out.finish_reasons) == {"stop", "length"}


def test_ignore_eos_samples_to_max_tokens(model_dir: Path) -> None:
    """rollout.ignore_eos: EOS is suppressed until max_tokens; the log-probs stay the model's own."""
    sampling = SamplingCfg(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=48, ignore_eos=True)
    out = make_rollout(model_dir).generate(PROMPTS, sampling, expect_version=0)
    assert [len(r) for r in out.response_ids] == [48] * 24 and set(out.finish_reasons) == {"length"}
    assert all(EOS_ID not in r for r in out.response_ids)
    assert_logprobs_match(load_tiny_llama(model_dir), out)


def test_greedy_equals_transformers_greedy(model_dir: Path) -> None:
    out = make_rollout(model_dir).generate(PROMPTS, GREEDY, expect_version=0)
    model = load_tiny_llama(model_dir)
    for prompt, response in zip(PROMPTS, out.response_ids, strict=True):
        ref = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=16, eos_token_id=EOS_ID, pad_token_id=256
        )
        assert response == ref[0, len(prompt) :].tolist()
    assert_logprobs_match(model, out)


def test_same_seed_same_samples(model_dir: Path) -> None:
    a = make_rollout(model_dir, seed=3).generate(PROMPTS, SAMPLE, expect_version=0)
    b = make_rollout(model_dir, seed=3).generate(PROMPTS, SAMPLE, expect_version=0)
    assert a.response_ids == b.response_ids


def test_seed_argument_makes_a_call_repeatable(model_dir: Path) -> None:
    rollout = make_rollout(model_dir)
    first = rollout.generate(PROMPTS, SAMPLE, expect_version=0, seed=7)
    rollout.generate(PROMPTS, SAMPLE, expect_version=0)  # calls in between do not matter
    assert rollout.generate(PROMPTS, SAMPLE, expect_version=0, seed=7).response_ids == first.response_ids
    assert rollout.generate(PROMPTS, SAMPLE, expect_version=0, seed=8).response_ids != first.response_ids


def test_merged_load_changes_outputs_and_versions(model_dir: Path) -> None:
    rollout = make_rollout(model_dir)
    before = rollout.generate(PROMPTS, GREEDY, expect_version=0)
    model = perturbed_state(model_dir)
    rollout.load_weights(WeightExport("merged", dict(model.state_dict())), version=1)
    with pytest.raises(StaleWeightsError):
        rollout.generate(PROMPTS, GREEDY, expect_version=0)
    after = rollout.generate(PROMPTS, GREEDY, expect_version=1)
    assert after.weight_version == 1 and after.response_ids != before.response_ids
    assert_logprobs_match(model, after)
    with pytest.raises(ValueError, match="missing"):
        rollout.load_weights(
            WeightExport("merged", {"model.norm.weight": model.model.norm.weight}), version=2
        )


def test_adapter_load_two_versions(model_dir: Path) -> None:
    rollout = make_rollout(model_dir)
    base = rollout.generate(PROMPTS, GREEDY, expect_version=0)
    for version in (1, 2):
        export, peft_model = lora_export(model_dir, seed=version)
        rollout.load_weights(export, version=version)
        out = rollout.generate(PROMPTS, GREEDY, expect_version=version)
        assert out.response_ids != base.response_ids
        assert_logprobs_match(peft_model, out)
    with pytest.raises(StaleWeightsError):
        rollout.generate(PROMPTS, GREEDY, expect_version=1)


def test_bad_requests_are_rejected(model_dir: Path) -> None:
    rollout = make_rollout(model_dir)
    with pytest.raises(ValueError, match="greedy"):
        rollout.generate(
            PROMPTS,
            SamplingCfg(n=2, temperature=0, top_p=1, top_k=-1, max_tokens=4, greedy=True),
            expect_version=0,
        )
    with pytest.raises(ValueError, match="max_response_tokens"):
        rollout.generate(
            PROMPTS, SamplingCfg(n=1, temperature=1, top_p=1, top_k=-1, max_tokens=65), expect_version=0
        )
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        rollout.generate([[1] * 33], SAMPLE, expect_version=0)


def test_throughput_print(model_dir: Path) -> None:
    """Not a gate: prints generated tokens/s of the hf rollout on the tiny model (for benchmarks)."""
    rollout = make_rollout(model_dir)
    prompts = [PROMPTS[i % 3] for i in range(16)]
    sampling = SamplingCfg(n=4, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64)
    start = time.perf_counter()
    out = rollout.generate(prompts, sampling, expect_version=0)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(r) for r in out.response_ids)
    print(
        f"\nhf rollout, tiny llama: {num_tokens} tokens in {seconds:.2f} s = {num_tokens / seconds:.0f} tokens/s"
    )
    assert num_tokens > 0
