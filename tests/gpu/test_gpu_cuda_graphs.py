"""trainer.cuda_graphs (rlbridge/engines/hf/graphs.py) on the device: an engine that replays its recorded passes
against one that runs every pass eagerly, in lockstep over optimizer steps (CUDA only: a CPU has no graphs).

SmolLM2-135M-Instruct with LoRA rank 8 on all linear layers (B ~ N(0, 0.05), so the adapters matter from the
first pass), GRPO's loss on random advantages, 8 steps over batches of 3 shapes met again and again (A B A A C B
A C: each shape's first pass is eager and recorded, the later ones replayed), 2 passes per step (a token budget);
the eager engine runs the same pass layout (prompt and response widths rounded to 16 each), so only the graphs
differ.
After every step both engines' eager no-gradient log-probs of a fixed batch are compared: a trainer whose
graphs kept computing with the weights of their recording (as compiled layers did: bench/results/
compile_loop-gpu-2026-12-03.md) would fall behind here step by step. Bounds: float32: the same kernels on the same
inputs, so per-step gradient norms within 1e-5 relative, adapters within 1e-6 and log-probs within 1e-4 (summation
order of other kernels, if a capture picked any); bfloat16: gradient norms within 2 %, log-probs of the two
engines within 0.02 mean after 8 steps (bf16 noise; the engines start equal). Figures: the differences, the
number of replayed passes, eager and replayed seconds per step."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.common import DRY_RUN, TEXTS, chat_prompt_ids, figure

pytestmark = [pytest.mark.timeout(600)]

SHAPES = "ABAACBAC"


def _engine(model_dir: Path, dtype: str, graphs: bool, **trainer: Any) -> Any:
    """An hf engine on CUDA, LoRA rank 8 on all linear layers with B ~ N(0, 0.05) (the adapters matter from the
    first pass); trainer.cuda_graphs as `graphs`, `trainer` added to the trainer section."""
    import torch

    from rlbridge.engines.hf.engine import HFTrainEngine
    from rlbridge.recipe.schema import Recipe

    raw = {"name": "t", "model": {"path": str(model_dir), "dtype": dtype},
           "lora": {"rank": 8, "alpha": 16, "targets": ["all-linear"]},
           "trainer": {"cuda_graphs": graphs, "optim": {"lr": 1e-3}, **trainer},
           "rollout": {"n": 4, "max_response_tokens": 40},
           "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
           "cluster": {"device": "cuda"}}  # fmt: skip
    eng = HFTrainEngine(Recipe.model_validate(raw), model_dir, device="cuda")
    b_init = torch.Generator().manual_seed(1)
    eng.load_trainable_state({n: torch.randn(t.shape, generator=b_init) * 0.05 if "lora_B" in n else t
                              for n, t in eng.trainable_state().items()})  # fmt: skip
    return eng


@pytest.mark.skipif(DRY_RUN, reason="CUDA graphs need CUDA: no CPU dry run")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_passes_train_as_the_eager_ones(dtype: str, model_dir: Path) -> None:
    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.batch import SeqBatch
    from rlbridge.model.hf import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    gen = torch.Generator().manual_seed(0)
    prompts = [chat_prompt_ids(tok, q) for q, _ in TEXTS[:4]]

    def batch_of(longest: int, seed: int) -> SeqBatch:
        """16 rows: 4 prompts x 4 random responses whose lengths depend on `longest` only, so batches of one
        shape letter make passes of the same shapes (with masked columns: prompts and responses of several
        lengths), and different tokens."""
        g = torch.Generator().manual_seed(seed)
        lengths = [longest - (i % 4) * (longest // 6) for i in range(16)]
        responses = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
        return SeqBatch.from_token_lists([p for p in prompts for _ in range(4)], responses, pad_id=0)

    lengths = {"A": 24, "B": 40, "C": 12}
    batches = [batch_of(lengths[s], i) for i, s in enumerate(SHAPES)]
    probe = batch_of(32, 99)
    advs = [
        torch.randn(b.size, 1, generator=gen).expand(-1, b.response_width) * b.response_mask for b in batches
    ]

    def engine(graphs: bool) -> Any:
        return _engine(model_dir, dtype, graphs, max_tokens_per_micro_batch=8 * 96)

    def rel(got: float, want: float) -> float:
        """|got - want| / |want|; 0 where both are the same number, or both not finite (a step both skipped)."""
        if got == want or not (math.isfinite(got) or math.isfinite(want)):
            return 0.0
        return abs(got - want) / max(abs(want), 1e-12)

    eager, graphed = engine(False), engine(True)
    eager.sides = (
        True  # the recorded passes' layout (SeqBatch.sides_rounded, exact on its own: test_padding_free)
    )
    initial = graphed.trainable_state()
    rows: list[dict[str, float]] = []
    for step, (batch, adv) in enumerate(zip(batches, advs, strict=True)):
        out = {}
        for name, eng in (("eager", eager), ("graphed", graphed)):
            fn = make_loss_fn(eng.recipe.algorithm, LossInputs(adv, batch.response_mask, None, None, None),
                              norm_constant=40.0, micro_scale=1.0)  # fmt: skip
            torch.cuda.synchronize()
            start = time.perf_counter()
            m = eng.train_step(batch, fn, num_micro_batches=1)
            torch.cuda.synchronize()
            out[name] = {**m, "seconds": time.perf_counter() - start, "logp": eng.logprobs(probe).cpu()}
        state_e, state_g = eager.trainable_state(), graphed.trainable_state()
        real = probe.response_mask > 0
        rows.append({
            "step": step, "shape": SHAPES[step], "replayed": out["graphed"].get("cuda_graph_passes", 0.0),
            "grad_norm": out["eager"]["grad_norm"], "skipped": out["eager"]["skipped"] + out["graphed"]["skipped"],
            "nonfinite": len(out["eager"].get("nonfinite", [])), "nonfinite_first": out["eager"].get("nonfinite", [])[:2],
            "grad_norm_rel": rel(out["graphed"]["grad_norm"], out["eager"]["grad_norm"]),
            "adapter_diff_max": max(float((state_g[k] - v).abs().max()) for k, v in state_e.items()),
            "logp_diff_mean": float((out["graphed"]["logp"] - out["eager"]["logp"]).abs()[real].mean()),
            "eager_s": out["eager"]["seconds"], "graphed_s": out["graphed"]["seconds"],
        })  # fmt: skip
    figure(f"cuda_graphs_{dtype}", steps=rows, captures=graphed._graphs.captures, off=graphed._graphs.off)
    assert graphed._graphs.off is None, graphed._graphs.off
    assert sum(r["replayed"] for r in rows) >= 8, rows  # 5 of 8 steps met a recorded shape, 2 passes each
    assert all(r["replayed"] == 0 for r in rows[:2]), rows  # A and B met first: eager, then recorded
    changed = max(float((graphed.trainable_state()[k] - v).abs().max()) for k, v in initial.items())
    assert changed > 1e-3, changed  # the adapters did train
    if dtype == "float32":
        assert all(r["grad_norm_rel"] <= 1e-5 for r in rows), rows
        assert all(r["adapter_diff_max"] <= 1e-6 for r in rows), rows
        assert all(r["logp_diff_mean"] <= 1e-4 for r in rows), rows
    else:
        assert all(r["grad_norm_rel"] <= 0.02 for r in rows), rows
        assert rows[-1]["logp_diff_mean"] <= 0.02, rows


@pytest.mark.skipif(DRY_RUN, reason="CUDA graphs need CUDA: no CPU dry run")
def test_prerecorded_passes_change_nothing_and_replay_from_the_first_step(model_dir: Path) -> None:
    """HFTrainEngine.prerecord (the trainer's start under trainer.cuda_graphs): the shapes the prompt lengths make
    likely are recorded before any step, leaving the adapters, their gradients and the random generators as they
    were; a step whose pass has a recorded shape then replays it at once (no eager pass, no recording) and trains
    as an eager engine does (float32: gradient norm within 1e-5 relative, adapters within 1e-6)."""
    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.batch import SeqBatch
    from rlbridge.model.hf import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [chat_prompt_ids(tok, q) for q, _ in TEXTS[:4]]
    g = torch.Generator().manual_seed(3)
    responses = [torch.randint(0, 49152, (30 - i,), generator=g).tolist() for i in range(16)]
    batch = SeqBatch.from_token_lists([p for p in prompts for _ in range(4)], responses, pad_id=0)
    adv = torch.randn(16, 1, generator=g).expand(-1, batch.response_width) * batch.response_mask

    def engine(graphs: bool) -> Any:
        eng = _engine(model_dir, "float32", graphs)
        eng.sides = True
        return eng

    eager, graphed = engine(False), engine(True)
    before = graphed.trainable_state()
    rng = torch.cuda.get_rng_state(), torch.get_rng_state()
    start = time.perf_counter()
    recorded = graphed.prerecord([len(p) for p in prompts], [(16, 1)])
    seconds = time.perf_counter() - start
    assert recorded >= 3, recorded  # the responses' widths 48, 32, 16 at the longest prompt's width at least
    assert graphed._graphs.captures == recorded and graphed._graphs.off is None
    assert all(torch.equal(v, before[k]) for k, v in graphed.trainable_state().items())
    assert all(p.grad is None for p in graphed.model.parameters())
    assert torch.equal(torch.cuda.get_rng_state(), rng[0]) and torch.equal(torch.get_rng_state(), rng[1])
    out = {}
    for name, eng in (("eager", eager), ("graphed", graphed)):
        fn = make_loss_fn(eng.recipe.algorithm, LossInputs(adv, batch.response_mask, None, None, None),
                          norm_constant=40.0, micro_scale=1.0)  # fmt: skip
        out[name] = eng.train_step(batch, fn, num_micro_batches=1)
    diff = max(
        float((graphed.trainable_state()[k] - v).abs().max()) for k, v in eager.trainable_state().items()
    )
    rel = abs(out["graphed"]["grad_norm"] - out["eager"]["grad_norm"]) / out["eager"]["grad_norm"]
    figure("cuda_graphs_prerecord", recorded=recorded, seconds=seconds, replayed=out["graphed"]["cuda_graph_passes"],
           grad_norm_rel=rel, adapter_diff_max=diff)  # fmt: skip
    assert out["graphed"]["cuda_graph_passes"] == 1.0, out["graphed"]  # the step's one pass: replayed at once
    assert graphed._graphs.captures == recorded  # nothing recorded during the step
    assert rel <= 1e-5 and diff <= 1e-6, (rel, diff)
