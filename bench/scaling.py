"""How the cost of a quickstart step grows on CPU: step time against batch size and response length.

`rlbridge train recipes/quickstart.yaml` (SmolLM2-135M, LoRA r16, vLLM-CPU rollout, hf trainer, merged
sync) for `--warmup` + `--steps` steps per setting, with data.val=null, measured as bench/trl_grpo.py
measures rlbridge: wall time per step from the arrival of metrics.jsonl lines, the phases rlbridge logs
(generate, reward, update, sync), generated and trained (prompt + response) tokens, CPU seconds and peak
PSS of the process tree, the load average. Two sweeps around the quickstart (8 prompts x 4, 48 tokens):
prompts per step 4, 8, 16 at 48 tokens, and max_response_tokens 16, 32, 64 at 8 prompts. The settings run
interleaved (one of each sweep in turn) so that a change of load on a shared machine spreads over both.

    python bench/scaling.py [--steps 2] [--warmup 1] [--batch 4 8 16] [--length 16 32 64]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.proctree import load_average  # noqa: E402
from bench.trl_grpo import recipe, run_rlbridge, step_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--batch", type=int, nargs="+", default=[4, 8, 16], help="prompts per step (x rollout.n=4)"
    )
    ap.add_argument("--length", type=int, nargs="+", default=[16, 32, 64], help="max_response_tokens")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    total = a.steps + a.warmup
    settings = [("batch", b) for b in a.batch]
    lengths = [("length", n) for n in a.length]
    order = [s for pair in itertools.zip_longest(settings, lengths) for s in pair if s is not None]
    work = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    rows: list[dict[str, Any]] = []
    runs = []
    for sweep, value in order:
        sets = [f"data.batch_size={value}"] if sweep == "batch" else [f"rollout.max_response_tokens={value}"]
        r = recipe(total, sets)
        print(f"[bench] {sweep}={value}, load {load_average()}", file=sys.stderr, flush=True)
        res = run_rlbridge(total, a.warmup, sets, work, step_prompts(r, total), r.rollout.n)
        res.update(
            sweep=sweep,
            prompts=r.data.batch_size,
            sequences=r.rollouts_per_step,
            max_response_tokens=r.rollout.max_response_tokens,
        )
        runs.append(res)
        ph = res["phases_s"]
        rows.append(
            {
                "sweep": sweep,
                "prompts": res["prompts"],
                "max_tokens": res["max_response_tokens"],
                "step_s": res["step_s"],
                "generate_s": ph.get("generate"),
                "update_s": ph.get("update"),
                "sync_s": ph.get("sync"),
                "gen_tokens": res["generated_tokens_per_step"],
                "trained_tok_per_s": res["trained_tokens_per_s"],
                "step_cpu_s": res["step_cpu_s"],
                "peak_pss_gib": res["peak_pss_gib"],
                "load": res["load_avg_during_steps"],
            }
        )
    rows.sort(key=lambda x: (x["sweep"], x["prompts"], x["max_tokens"]))
    from bench.common import report

    report(
        "scaling",
        {
            "settings": {
                "steps": a.steps,
                "warmup": a.warmup,
                "batch": a.batch,
                "length": a.length,
                "recipe": "recipes/quickstart.yaml + data.val=null",
            },
            "runs": runs,
        },
        rows,
        save=not a.no_save,
    )


if __name__ == "__main__":
    main()
