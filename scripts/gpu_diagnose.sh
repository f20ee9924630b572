#!/usr/bin/env bash
# One-off diagnosis on a fresh GPU machine (cold caches): where vLLM's start-up time goes (plain process vs
# Ray actor, LoRA on vs off), and the landed quickstart through the CLI with adapter sync, side by side.
# Usage on the GPU machine (after .gpu_site/receive.sh): bash scripts/gpu_diagnose.sh   (results under $OUT)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import torch, vllm, transformers, peft, os, shutil
print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
print("nvcc", shutil.which("nvcc"), "cpus", os.cpu_count(), "affinity", len(os.sched_getaffinity(0)))
print("home caches", [p for p in ("~/.cache/vllm", "~/.triton", "~/.cache/flashinfer", "/tmp/torchinductor_root") if os.path.exists(os.path.expanduser(p))])
PY
python -c "from rlbridge.model_cache import ensure_model; print(ensure_model('smollm2-135m-instruct'))" > "$OUT/model.txt" 2>&1
# the CLI run: landed code, adapter sync, cold caches of this fresh machine
( timeout ${CLI_S:-480} python -m rlbridge train recipes/quickstart.yaml --set cluster.device=cuda \
    --set model.dtype=bfloat16 --set rollout.weight_sync=adapter --set run.steps=4 --set run.eval_samples=16 \
    --set rollout.gpu_memory_utilization=0.25 --run-dir "$OUT/run_cli" > "$OUT/cli.log" 2>&1; echo "cli exit $?" >> "$OUT/cli.log" ) &
timeout ${BENCH_S:-500} python -m bench.vllm_startup --conditions ${CONDITIONS:-plain,plain-merged,ray,ray-warm} \
    --out "$OUT/startup" --timeout 420 > "$OUT/startup.out" 2>&1
echo "bench exit $?"
wait
tail -30 "$OUT/cli.log"; tail -40 "$OUT/startup.out"
