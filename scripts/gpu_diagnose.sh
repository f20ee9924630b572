#!/usr/bin/env bash
# One-off diagnosis on a fresh GPU machine (cold caches), results under $OUT:
#  A (side by side): the quickstart through the CLI with adapter sync (cold caches of this machine) and
#    bench/vllm_startup.py's cold conditions (plain process vs Ray actor, LoRA on/off, a cache folder each);
#  B: bench/logprob_floor.py (which trainer numerics meet vLLM bf16) beside the warm Ray-actor start.
# Usage on the GPU machine (after .gpu_site/receive.sh): bash scripts/gpu_diagnose.sh
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import torch, vllm, transformers, peft, os, shutil
print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
print("nvcc", shutil.which("nvcc"), "cpus", os.cpu_count(), "affinity", len(os.sched_getaffinity(0)))
print("caches present", [p for p in ("~/.cache/vllm", "~/.triton", "~/.cache/flashinfer", "/tmp/torchinductor_root") if os.path.exists(os.path.expanduser(p))])
PY
python -c "from rlbridge.model_cache import ensure_model; print(ensure_model('smollm2-135m-instruct'))" > "$OUT/model.txt" 2>&1
( timeout ${CLI_S:-500} python -m rlbridge train recipes/quickstart.yaml --set cluster.device=cuda \
    --set model.dtype=bfloat16 --set rollout.weight_sync=adapter --set run.steps=4 --set run.eval_samples=16 \
    --set rollout.gpu_memory_utilization=0.2 --run-dir "$OUT/run_cli" > "$OUT/cli.log" 2>&1; echo "cli exit $?" >> "$OUT/cli.log" ) &
timeout ${A_S:-300} python -m bench.vllm_startup --conditions plain,plain-merged,ray --gpu-memory-utilization 0.12 \
    --out "$OUT/startup" --caches /tmp/vs_caches --timeout 290 > "$OUT/startup.out" 2>&1
echo "startup bench exit $?"; grep '^\[vllm_startup\]' "$OUT/startup.out"
( timeout 240 python -m bench.vllm_startup --conditions ray-warm --gpu-memory-utilization 0.12 \
    --out "$OUT/startup" --caches /tmp/vs_caches --timeout 230 > "$OUT/startup_warm.out" 2>&1 ) &
timeout 270 python bench/logprob_floor.py --gpu-memory 0.2 --out "$OUT/logprob_floor.json" --no-save > "$OUT/logprob_floor.out" 2>&1
echo "logprob_floor exit $?"
wait
grep '^\[vllm_startup\]' "$OUT/startup_warm.out"
tail -25 "$OUT/cli.log"; tail -45 "$OUT/logprob_floor.out"
