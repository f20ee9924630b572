"""bench/packed_passes.py on the CPU in float32 (2 layers of the SmolLM2 shape): the hf engine with
trainer.packed_passes gives the padded engine's log-probs and gradients on the bench's batch, in fewer passes that
compute no padding, and both train steps run."""

from __future__ import annotations

from bench.packed_passes import main


def test_packed_passes_bench_checks_and_times_both_layouts() -> None:
    res = main(
        ["--layers", "2", "--batch", "8", "--prompt-min", "5", "--prompt-max", "20", "--response-min", "3",
         "--response-max", "30", "--max-tokens", "120", "--warmup", "0", "--steps", "1"]
    )  # fmt: skip
    assert res["padded_positions"] > res["real_tokens"]
    assert 1 <= res["passes"]["packed"] < res["passes"]["padded"]
    # measured 2.9e-6 and 1.8e-6 (float32 summation order)
    assert res["check"]["packed"]["logprob_max_abs"] < 1e-5
    assert res["check"]["packed"]["grad_max_rel"] < 1e-5
    assert all(len(t) == 1 for t in res["step_times_s"].values())


def test_packed_passes_bench_shares_prompts_with_samples() -> None:
    res = main(
        ["--layers", "2", "--batch", "8", "--samples", "4", "--prompt-min", "5", "--prompt-max", "20",
         "--response-min", "3", "--response-max", "30", "--max-tokens", "120", "--warmup", "0", "--steps", "1"]
    )  # fmt: skip
    assert set(res["step_times_s"]) == {"padded", "packed", "packed-shared"}
    for layout in ("packed", "packed-shared"):  # float32 summation order
        assert res["check"][layout]["logprob_max_abs"] < 1e-5, res["check"]
        assert res["check"][layout]["grad_max_rel"] < 1e-5, res["check"]
