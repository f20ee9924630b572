"""bench/packed_passes.py on the CPU in float32: the packed layout (one row per pass, varlen attention over the
rows' boundaries through transformers' attention interface) gives the padded layout's log-probs and LoRA gradients
for the same step, and its passes really ran the registered varlen attention."""

from __future__ import annotations

from bench.packed_passes import main


def test_packed_passes_match_the_padded_ones() -> None:
    res = main(
        ["--layers", "2", "--batch", "8", "--prompt-min", "5", "--prompt-max", "20", "--response-min", "3",
         "--response-max", "30", "--max-tokens", "200", "--warmup", "0", "--steps", "1"]
    )  # fmt: skip
    assert res["passes"] == {"padded": 2, "packed": 2}
    assert (
        res["padded_positions"] > res["real_tokens"]
    )  # the padded passes compute on padding, the packed ones not
    assert res["check"]["logprob_rows_compared"] >= 2
    # measured 9.5e-7 and 1.3e-6: float32 summation order
    assert res["check"]["logprob_max_abs"] < 1e-5
    assert res["check"]["grad_max_rel"] < 1e-5
    assert res["varlen_layer_calls"] == 2 * 2  # 2 layers x 2 packed passes
