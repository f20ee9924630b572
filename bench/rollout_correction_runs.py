"""Side-by-side figures of finished runs that differ in `algorithm.rollout_correction` (issue 17, item 5).

    python bench/rollout_correction_runs.py LABEL=RUN_DIR [LABEL=RUN_DIR ...] [--json OUT.json]

For each run directory: greedy held-out accuracy before / after (the eval rows of metrics.jsonl), the mean
over training steps of the trainer-vs-rollout figures (rc_* metrics, logprob_diff_mean), and the mean step
time and its update / old-log-prob parts (the forward that `bypass: true` skips). Prints one JSON object,
then a markdown table. How the GPU figures were made: bench/results/rollout_correction_gpu-*.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from rlbridge.report.run import read_run

STEP_MEANS = (
    "reward_mean",
    "logprob_diff_mean",
    "rc_weight_mean",
    "rc_weight_std",
    "rc_weight_min",
    "rc_weight_max",
    "rc_ess",
    "rc_clip_high_frac",
    "rc_masked_token_frac",
    "rc_log_ppl_diff",
    "rc_kl_k3",
    "rc_chi2",
    "time_step",
    "time_update",
    "old_logprobs_s",
)


def summarize(run_dir: Path) -> dict[str, Any]:
    run = read_run(run_dir)  # rlbridge report's reader: one record per step, also for a resumed run
    train, evals = run.train, run.evals
    out: dict[str, Any] = {"steps": len(train)}
    if evals:
        out["accuracy_before"] = evals[0].get("eval_accuracy")
        out["accuracy_after"] = evals[-1].get("eval_accuracy")
    for key in STEP_MEANS:
        values = [float(r[key]) for r in train if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = statistics.fmean(values)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    result = {}
    for item in args.runs:
        label, _, path = item.partition("=")
        result[label] = summarize(Path(path))
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    keys = ["steps", "accuracy_before", "accuracy_after", *STEP_MEANS]
    print("\n| figure (mean over steps) | " + " | ".join(result) + " |")
    print("|---|" + "---|" * len(result))
    for key in keys:
        cells = []
        for figures in result.values():
            v = figures.get(key)
            cells.append("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
