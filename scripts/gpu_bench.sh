#!/usr/bin/env bash
# The GPU benchmarks still owed by issues 16 and 18, as parts that fit a device call (600 s) each; run on the GPU
# machine after .gpu_site/receive.sh (PYTHONPATH /tmp/site). Each part writes under $OUT/<part>/ (default
# ./gpu_out) and stops at GPU_BENCH_BUDGET_S (default 560 s) from its start; results then go into bench/results/
# by hand, with the date and this command.
#
#   bash scripts/gpu_bench.sh smoke     # the GPU quickstart via the CLI, 3 steps: a guard before long parts (~1.5 min)
#   bash scripts/gpu_bench.sh async3    # issue 18: async seed 3 of the 30-step quickstart (ran 2026-12-02 in 252 s on a
#                                       # fresh machine: bench/results/async_runs-gpu-2026-12-02b.md)
#   bash scripts/gpu_bench.sh inloop    # issue 16 goal 1: the GPU quickstart at 64 x 8 = 512 rollouts, <= 256 tokens,
#                                       # 6 steps, without and with trainer.max_tokens_per_micro_batch 32768 (~2 x 3 min)
#   bash scripts/gpu_bench.sh gengap    # issue 16 goal 2: in-loop generation vs vLLM alone (its own engine process and
#                                       # in-process), same prompts, 512 rollouts x 256 tokens (281 s on a warm H100,
#                                       # 2026-12-02: bench/results/generation_gap-gpu-2026-12-02.md)
#   bash scripts/gpu_bench.sh update    # issue 16 goal 1: bench/update_padding.py, Qwen2.5-0.5B shape, LoRA and full FT (~3 min)
#   bash scripts/gpu_bench.sh updatemeg # issue 16 goal 1, megatron: the same batches through the megatron engine (budget
#                                       # 32768 ran out of memory on an H100 before forward.response_head; 8192: 222 s,
#                                       # bench/results/update_padding-gpu-2026-12-02c.md)
#   bash scripts/gpu_bench.sh passcost  # issue 16 goal 1: bench/pass_cost.py, kernels and GPU busy share of one pass (~1 min)
#   bash scripts/gpu_bench.sh memory    # issue 16 goal 7: trainer_gpu.py peaks vs the plan, 4 shapes x both engines (~8 min)
#   bash scripts/gpu_bench.sh trl       # issue 16 goal 4: TRL 1.16 GRPOTrainer vs rlbridge, quickstart size (8 x 4, <= 48
#                                       # tokens), 2 + 10 steps each; needs a site packed with EXTRA="trl==1.16.0" (325 s
#                                       # on a fresh machine on 2026-12-02: bench/results/trl_grpo-gpu-2026-12-02.md)
#   bash scripts/gpu_bench.sh trlasync  # trl, plus rlbridge with rollout.mode async (bench/trl_grpo.py --also-async; ~350 s incl.
#                                       # start-ups (156 + 86 + 109 s) on 2026-12-03; TRL_STEPS=30 for 30 timed steps instead of 10); and
#   bash scripts/gpu_bench.sh trl512async  # the same at 512 rollouts
#   bash scripts/gpu_bench.sh trl512    # issue 16 goal 4 at 512 rollouts (64 x 8, <= 256 tokens), 1 + 3 steps each, side by
#                                       # side (253 s on a warm H100, 2026-12-02: bench/results/trl_grpo-gpu-2026-12-02b.md)
#   bash scripts/gpu_bench.sh growth    # issue 16 goal 6 (and 7): bench/growth.py, 32 -> 2048 rollouts, 64 -> 1024 tokens;
#                                       # each point is a run with its own vLLM start (~140 s): 3 points fit one call,
#                                       # the last two (2048 x 256, 512 x 1024) took 430 s at --steps 2 in a second one
#   bash scripts/gpu_bench.sh growth2   # those last two points
#   bash scripts/gpu_bench.sh shared    # issue 16 goals 1/4: bench/shared_prompts.py, each distinct prompt once per pass
#                                       # against the plain passes: quickstart shape (8 x 4) and 64 x 8 at budget 32768
#   bash scripts/gpu_bench.sh klpasses  # 512 rollouts, KL 0.05: reference log-probs grouped as the training passes vs by 4 rows
#   bash scripts/gpu_bench.sh compile   # issue 16 goals 1/4: bench/compile_layers.py, the hf engine's LoRA step at the quickstart
#                                       # shape (32 rows, one pass) eager vs decoder layers compiled (dynamic shapes; then
#                                       # dynamic + CUDA graphs; then specialized per shape; 2026-12-03 on an H200: 1.63x
#                                       # after 72 s of compiling, CUDA graphs segfaulted, 1.45x: compile_layers-gpu-2026-12-03)
#   bash scripts/gpu_bench.sh compilestale  # bench/compile_stale_check.py: do compiled layers follow the weights as they
#                                       # train (compiled vs eager log-probs and gradient after each step; tiny model, ~1-2
#                                       # min estimate)? Owed before compiled layers become a trainer option again
#   bash scripts/gpu_bench.sh spikes    # issue 16 goal 4: the async quickstart as trlasync runs it (32 steps), its metrics.jsonl,
#                                       # worker logs and the GPU's utilization every 0.2 s kept flat under $OUT/spikes: what
#                                       # made 3 of 30 async updates take 1.5-2.2 s instead of 0.3 (trl_grpo-gpu-2026-12-04;
#                                       # ran in 205 s: cuDNN attention plans at a new width, sdpa_shapes-gpu-2026-12-04)
#   SPIKES_MODE=sync bash scripts/gpu_bench.sh spikes   # the same in sync mode
#   bash scripts/gpu_bench.sh widths    # issue 16 goal 4: bench/sdpa_shapes.py at trainer.pass_width_multiple 1, 16, 32 (cuDNN
#                                       # attention on): does rounding the pass widths remove the new-width stall (~2 min)
#   bash scripts/gpu_bench.sh trlwidth  # TRL, rlbridge async, rlbridge async at pass_width_multiple 16 (no plain sync run;
#                                       # TRLWIDTH_NOCUDNN=1 adds async with RLBRIDGE_CUDNN_ATTENTION=0; TRL_STEPS as trl)
#   bash scripts/gpu_bench.sh graphs    # issue 16 goal 4: bench/sdpa_shapes.py at width multiple 16, eager then
#                                       # trainer.cuda_graphs (no cProfile): the update with recorded passes (~2 min)
#   bash scripts/gpu_bench.sh trlgraphs # TRL, rlbridge async, rlbridge async with trainer.cuda_graphs (TRL_STEPS as trl;
#                                       # TRL_PLAIN_ASYNC=0: without the plain async run)
#   bash scripts/gpu_bench.sh rolloutstep  # bench/rollout_step.py: the rollout's share of an async quickstart step alone,
#                                       # vLLM built without LoRA vs with it + an adapter load per step (two vLLM starts; not run yet)
#   bash scripts/gpu_bench.sh engines2  # issue 43: two vLLM engines on the GPU vs one at 512 rollouts/step (two CLI runs)
#   bash scripts/gpu_bench.sh 7bhf      # issue 44: the 7B recipe (qwen2.5-7b-random) through the CLI on one GPU, hf engine,
#                                       # 5 steps of 32 x 8, plan vs measured memory (bench/size7b.py)
#   bash scripts/gpu_bench.sh 7bmeg     # the same with the megatron engine (STEPS7B=2: 2 steps, checkpoint at 2)
#   bash scripts/gpu_bench.sh 7bresume 7bexport  # after 7bhf on the same machine: kill -9 + resume, export-hf, vLLM
#   bash scripts/gpu_bench.sh 7bfit     # issue 44 item 3: the biggest budget the plan accepts fits; the next is refused
#   bash scripts/gpu_bench.sh mfu7b     # issue 44 item 2: MFU of the update at the 7B shape (bench/trainer_gpu.py; 447 s with
#                                       # the site's unpacking on a fresh H100, 2026-12-07: mfu7b-gpu-2026-12-07)
#   bash scripts/gpu_bench.sh mfu7btf32 # the same with CUDA float32 matmuls on TF32 (the float32 output layer) and its log-prob gap
#   bash scripts/gpu_bench.sh tf32ab    # the output layer's product on TF32 (engines/float32_head) vs exact float32, mfu7b's
#                                       # jobs unprofiled, one run each way alternated per mode (TF32AB_MODES, default
#                                       # "full lora"; TF32AB_ENGINES, default "megatron,hf"), with the log-prob gap on the
#                                       # batch; a run of the 7B took ~220-270 s
#                                       # with its start when each run initialized its own random 7B (446 s for the full
#                                       # pair on an H100: tf32head-gpu-2026-12-07); the models are now saved once per machine
#   bash scripts/gpu_bench.sh loradtype # the hf engine's LoRA step at the 7B shape with float32 adapters vs lora.compute_dtype
#                                       # model (bf16 adapters, float32 masters), alternated, 2 rounds (3 of 4 runs in 430 s on a
#                                       # fresh H100, 2026-12-07: loradtype-gpu-2026-12-07)
#   bash scripts/gpu_bench.sh packed    # issue 47 item 3: the hf engine's update in padded token-budget passes vs
#                                       # trainer.packed_passes (and with shared prompts), 512 GSM8K-like rows (64
#                                       # prompts x 8), smollm2-135m and qwen2.5-0.5b
#                                       # (PACKED_MODELS), bench/packed_passes.py; smollm2 ran in ~130 s on an H100,
#                                       # qwen2.5-0.5b at 16384 tokens on cards other than 139 GiB (out of memory at
#                                       # 32768 on an H100: packed_passes-gpu-2026-12-07). In the loop: AB_ARGS="--rlbridge-set trainer.packed_passes=true
#                                       # --rlbridge-set trainer.shared_prompts=always" with ab512
#   bash scripts/gpu_bench.sh plan7b    # issue 44 item 3: mfu7b's jobs with trainer.recompute full: the plan's trainer memory vs the peaks
#                                       # (ran 2026-12-07 on an H100 as two trainer_gpu calls, 43 + 54 s on a machine holding the
#                                       # saved models: mfu7b-gpu-2026-12-07)
#   bash scripts/gpu_bench.sh 30b       # issue 44 item 5: recipes/qwen3-30b-a3b-moe-lora.yaml on ONE H200 (not an H100: the
#                                       # plan needs 0.74 of an 80 GiB device for vLLM alone), qwen3-30b-a3b-random, vLLM at
#                                       # 0.45, ENGINE30B (default megatron) for STEPS30B (default 2) steps; the first call
#                                       # materializes 57 GiB of weights (the machine's disk is 64 GiB: nothing else big
#                                       # beside it) and may be cut by the budget: call it again on the same machine
#   bash scripts/gpu_bench.sh ab        # issue 47, bench/README.md's protocol: rlbridge sync (recipes/quickstart-gpu.yaml) and
#                                       # TRL 1.16 GRPOTrainer tuned (the whole batch of 32 in one micro-batch, gradient
#                                       # accumulation 1, colocated vLLM, no sleep: it fits) alternated A B A B, 3 rounds
#                                       # asked, 1 + 8 steps each; rounds that do not fit the budget are not started
#                                       # (3 rounds each in 370 s on a fresh H100 on 2026-12-06: ab-gpu-2026-12-06); every round's JSON flat in $OUT/ab, with
#                                       # summary.json / summary.md ("sync vs sync", ratio of medians, min-max over rounds)
#   bash scripts/gpu_bench.sh ab512     # the same at 64 x 8 = 512 rollouts, <= 256 tokens, 1 + 3 steps: 2 rounds each (3 do
#                                       # not fit 560 s: ~190-280 s a round by the committed trl512 runs); TRL with the
#                                       # whole batch of 512 in one micro-batch, which fits only with its gradient
#                                       # checkpointing (TRL's default) on
#                                       # AB_ROUNDS / AB_STEPS change the rounds / timed steps, AB_ARGS adds arguments of
#                                       # bench/ab_rounds.py (e.g. "--trl-config vllm_enable_sleep_mode=true"; vLLM's
#                                       # CUDA graphs up to the run's largest batch, the start-up lever of 2026-12-06,
#                                       # need no setting now: see startgraphs)
#                                       # Packed passes with shared prompts: AB_ARGS="--rlbridge-set trainer.packed_passes=true
#                                       # --rlbridge-set trainer.shared_prompts=always" (1.63x, ab512-gpu-2026-12-07b);
#                                       # adding "--rlbridge-set trainer.max_tokens_per_micro_batch=16384" keeps vLLM resident
#                                       # on an 80 GB card (the plan: no sleep, wake or emptied cache per update); the
#                                       # metrics' train_steps_s / release_s split each update's trainer_update_s
#   bash scripts/gpu_bench.sh prof512   # issue 47: the loop's 3rd update at 512 rollouts profiled (packed + shared prompts)
#                                       # at 32768 and 16384 tokens per pass (PROF_BUDGETS); profiles in $OUT/prof512
#   bash scripts/gpu_bench.sh levers512 # issue 47: rlbridge alone at 512 rollouts (packed + shared prompts), 1 + 4 steps per
#                                       # lever: adapter sync, merged weights by CUDA IPC, bf16 adapters, Ray without its idle
#                                       # worker per core at start (LEVERS); ~80 s each warm (adapter and merged ran in
#                                       # 390 s with the machine's first vLLM start: ab512pick-gpu-2026-12-08)
#   bash scripts/gpu_bench.sh ab512pick # ab512, 3 rounds, packed + shared prompts, with the weight sync (adapter or merged
#                                       # by CUDA IPC) levers512 found fastest on this machine: after levers512, same OUT
#                                       # (merged, 3 rounds each in 520 s on an H100: ab512pick-gpu-2026-12-08)
#   bash scripts/gpu_bench.sh abasync   # "async vs async": rlbridge recipes/quickstart-gpu-fast.yaml (async, max_staleness 1,
#                                       # CUDA graphs) against TRL's AsyncGRPOTrainer at max_staleness 1 with its vLLM server
#                                       # (trl vllm-serve's command, LoRA adapter sync) on the same GPU, whole batch per
#                                       # optimizer step (bench/trl_async.py); TRL's FlashAttention-3 comes from the Hub, so
#                                       # without the kernels package torch's varlen attention stands in (the summary says
#                                       # which); 3 rounds asked, 1 + 8 steps (2 rounds each fit 560 s on an
#                                       # H100: abasync-gpu-2026-12-07)
#   bash scripts/gpu_bench.sh eqwall    # issue 47 item 4: held-out accuracy after the same wall time (bench/equal_wall.py),
#                                       # GPU quickstart, TRL / rlbridge sync / async, EQWALL_S (90) s each, one seed a call
#                                       # (EQWALL_SEED); NOT yet run on a GPU (~3 x 130 s estimated)
#   bash scripts/gpu_bench.sh startgraphs  # vLLM's CUDA graphs captured up to the run's largest batch (32 rows at the
#                                       # GPU quickstart without evaluation) against vLLM's default grid up to 512:
#                                       # bench/startup_marks.py, 1-step CLI runs alternated, 3 rounds (~6 x 60 s); NOT yet
#                                       # run on a GPU
#   bash scripts/gpu_bench.sh abasync512  # the same at 512 rollouts, <= 256 tokens, 1 + 3 steps, 2 rounds; TRL with gradient
#                                       # checkpointing (one micro-batch of 512); on an 80 GB card vLLM at 0.22 and rlbridge's
#                                       # passes at 24576 tokens (the plan's fit); one round each per 560 s call on an H100
#                                       # (a pair ~345 s: abasync512-gpu-2026-12-07)
#   bash scripts/gpu_bench.sh async3 update   # several parts in order under one budget
#
# The GPU quickstart sets rollout.sleep auto since 2026-12-02's twelfth session (vLLM resident through the update
# where the plan fits both); the figures of earlier runs were taken with vLLM sleeping every step.
set -uo pipefail

main() {
[ $# -eq 0 ] && { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-$(command -v python || command -v python3)}
deadline=$(( $(date +%s) + ${GPU_BENCH_BUDGET_S:-560} ))
# --also arguments of bench/trl_grpo.py for an async variant NAME with these overrides besides async's own
async_variant() {
  local name=$1; shift
  for o in rollout.mode=async rollout.max_staleness=1 algorithm.rollout_correction.weights=token "$@"; do
    echo "--also $name:$o"
  done
}
# TRL, rlbridge async and the variants (--also ...) at the GPU quickstart, TRL_STEPS timed steps; the run dirs are too
# deep to come back: each run's metrics and worker logs are kept flat in $OUT/PART
trl_async() {
  local part=$1; shift
  timeout "$(left)" "$PY" bench/trl_grpo.py --recipe recipes/quickstart-gpu.yaml --steps "${TRL_STEPS:-10}" --warmup 2 \
    --rlbridge-set trainer.max_tokens_per_micro_batch=32768 --work "$OUT/$part/work" --no-save --no-plain $([ "${TRL_PLAIN_ASYNC:-1}" = 1 ] && echo --also-async) "$@" \
    > "$OUT/$part/log.txt" 2>&1
  cp "$OUT/$part"/work/*.metrics.* "$OUT/$part/" 2>/dev/null; rm -rf "$OUT/$part/work"
  grep -E "^\[bench\]|_step_s_(median|mean)\"" "$OUT/$part/log.txt" | tail -20
}
left() { echo $(( deadline - $(date +%s) )); }
# train512 PART NAME [VAR=value ...] -- [rlbridge train arguments]: the GPU quickstart at 512 rollouts (scale, below),
# 1 + 4 steps, packed passes with shared prompts, under the variables given; its console log, metrics and worker logs
# kept flat in $OUT/PART as NAME.*, the run directory removed
train512() {
  local part=$1 name=$2 envs=(); shift 2
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  local dir="/tmp/rlb-$part-$name"
  rm -rf "$dir"
  env ${envs[@]+"${envs[@]}"} timeout "$(left)" "$PY" -m rlbridge train recipes/quickstart-gpu.yaml --run-dir "$dir" \
    "${scale[@]}" --set run.steps=5 --set trainer.packed_passes=true --set trainer.shared_prompts=always "$@" \
    > "$OUT/$part/$name.log" 2>&1
  echo "$name rc $?"; cp "$dir/metrics.jsonl" "$OUT/$part/$name.metrics.jsonl" 2>/dev/null
  for worker in trainer rollout; do cp "$dir/logs/$worker.log" "$OUT/$part/$name.$worker.log" 2>/dev/null; done
  rm -rf "$dir"
}
# on a card more than 5 % from the GPU recipes' 139 GiB, the plan is made for the card the run is on (rlbridge train
# refuses a planned peak above the real GPUs: an 80 GB card does not hold 139 GiB's plan at 512 rollouts)
card=(); gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null |
  awk '{g = $1 / 1024; d = (g - 139) / g; if (d > 0.05 || d < -0.05) printf "%.1f", g - 0.05}')
[ -n "$gib" ] && card=(--set "cluster.gpu_memory_gib=$gib")
scale=("${card[@]}" --set data.batch_size=64 --set rollout.n=8 --set rollout.max_response_tokens=256 --set run.eval_every=0)
# bench/ab_rounds.py's work at 512 rollouts (ab512, ab512pick, abasync512): <= 256 tokens, 1 + 3 steps, TRL with the
# whole batch of 512 in one micro-batch, which fits only with its gradient checkpointing (TRL's default) on
at512=("${card[@]}" --set data.batch_size=64 --set rollout.n=8 --set rollout.max_response_tokens=256
       --steps "${AB_STEPS:-3}" --warmup 1 --trl-config gradient_checkpointing=true)
# ab_rounds PART [bench/ab_rounds.py arguments]: the rounds under the part's budget (AB_ARGS added), every file flat
# in $OUT/PART, its summary lines shown
ab_rounds() {
  local part=$1; shift
  # shellcheck disable=SC2086  # AB_ARGS: extra words on purpose
  timeout "$(left)" "$PY" bench/ab_rounds.py "$@" --out "$OUT/$part" --budget-s $(( $(left) - 15 )) ${AB_ARGS:-} \
    > "$OUT/$part/log.txt" 2>&1
  grep -E "^\[ab\]|^(sync|async) vs|Error|refuse|fix:|^  [a-z_]+\." "$OUT/$part/log.txt" | tail -14
}
for part in "$@"; do
  mkdir -p "$OUT/$part"
  echo "== $part, $(date -u +%H:%M:%SZ), $(left) s left"
  case "$part" in
    smoke)  # the GPU quickstart through the CLI, 3 steps (one vLLM engine through the rollout group): a guard before
            # the long parts, its step lines and metrics kept in $OUT/smoke
      timeout "$(left)" "$PY" -m rlbridge train recipes/quickstart-gpu.yaml --run-dir /tmp/rlb-smoke --set run.steps=3 \
        > "$OUT/$part/log.txt" 2>&1
      echo "rc $?"; cp /tmp/rlb-smoke/metrics.jsonl "$OUT/$part/" 2>/dev/null; rm -rf /tmp/rlb-smoke
      grep -E "^step|Error|error:" "$OUT/$part/log.txt" | tail -8 ;;
    async3)
      timeout "$(left)" "$PY" bench/async_runs.py --recipe recipes/quickstart-gpu.yaml --steps 30 --seeds 3 --modes async --no-save \
        --json "$OUT/$part/async_seed3.json" --out "$OUT/$part/runs" > "$OUT/$part/log.txt" 2>&1
      grep -E "^(sync|async) seed" "$OUT/$part/log.txt" ;;
    inloop)
      for budget in none 32768; do
        sets=("${scale[@]}" --set run.steps=6)
        [ "$budget" != none ] && sets+=(--set trainer.max_tokens_per_micro_batch=$budget)
        timeout "$(left)" "$PY" -m rlbridge train recipes/quickstart-gpu.yaml --run-dir "$OUT/$part/$budget" "${sets[@]}" \
          > "$OUT/$part/$budget.log" 2>&1
        rm -rf "$OUT/$part/$budget/checkpoints"
        grep -E "^step|done" "$OUT/$part/$budget.log" | tail -7
      done ;;
    prof512)  # issue 47: where the loop's update goes at 512 rollouts (sync, packed passes + shared prompts): the 3rd
              # update of each run profiled (RLBRIDGE_PROFILE_UPDATE, trainer/profile.py) at PROF_BUDGETS tokens per
              # pass (default "32768 16384": vLLM sleeps beside the update at 32768 on an 80 GB card, stays at 16384)
      for budget in ${PROF_BUDGETS:-32768 16384}; do
        train512 "$part" "$budget" RLBRIDGE_PROFILE_UPDATE="$OUT/$part/$budget-profile#3" -- \
          --set trainer.max_tokens_per_micro_batch="$budget"
        grep -E "^step|Error|error:" "$OUT/$part/$budget.log" | tail -6
        head -16 "$OUT/$part/$budget-profile"/update-3-*.txt 2>/dev/null
      done ;;
    levers512)  # issue 47: the next levers at 512 rollouts, rlbridge alone, sync, packed passes + shared prompts, 1 + 4 steps
                # each: the adapter sync as the GPU quickstart has it (vLLM's LoRA graphs only since c5b387e), merged
                # weights by CUDA IPC (no LoRA kernels in vLLM's decode, one graph per size), bf16 adapters in the
                # trainer (lora.compute_dtype model: fewer casts, tensor-core GEMMs); LEVERS picks some
      for lever in ${LEVERS:-adapter merged bf16lora noprestart}; do
        case "$lever" in
          merged) train512 "$part" "$lever" -- --set rollout.weight_sync=merged --set rollout.weight_transport=cuda_ipc ;;
          bf16lora) train512 "$part" "$lever" -- --set lora.compute_dtype=model ;;
          noprestart) train512 "$part" "$lever" RAY_prestart_worker_first_driver=0 -- ;;  # Ray: no idle worker per core
          *) train512 "$part" "$lever" -- ;;
        esac
        grep -E "engine up|model loaded|^[0-9.]+s  \(|Error|error:" "$OUT/$part/$lever.log" | tail -7
      done ;;
    ab512pick)  # ab512 (3 rounds, packed passes + shared prompts) with the weight sync that levers512 measured fastest
                # on this machine (adapter or merged by CUDA IPC: the median step after the first; both are the same
                # work as TRL's, whose colocated vLLM gets merged weights): call it after levers512 with the same OUT
      sync=$("$PY" - "$OUT/levers512" <<'PICK'
import json, statistics, sys
from pathlib import Path
medians = {}
for lever in ("adapter", "merged"):
    path = Path(sys.argv[1]) / f"{lever}.metrics.jsonl"
    steps = [json.loads(line) for line in path.open()] if path.exists() else []
    times = [r["time_step"] for r in steps if r.get("kind") == "train"][1:]
    if times:
        medians[lever] = statistics.median(times)
best = min(medians, key=medians.__getitem__) if medians else "none"
print(f"median step after the first: {medians}", file=sys.stderr)
print(best)
PICK
)
      echo "ab512pick: weight sync $sync"
      [ "$sync" = none ] && { echo "no levers512 metrics in $OUT/levers512: run levers512 first"; continue; }
      pick=(--rlbridge-set trainer.packed_passes=true --rlbridge-set trainer.shared_prompts=always)
      [ "$sync" = merged ] && pick+=(--rlbridge-set rollout.weight_sync=merged --rlbridge-set rollout.weight_transport=cuda_ipc)
      ab_rounds "$part" --recipe recipes/quickstart-gpu.yaml "${at512[@]}" --rounds "${AB_ROUNDS:-3}" "${pick[@]}" ;;
    klpasses)  # the reference log-prob pass at 512 rollouts, KL on: grouped as the training passes (the default,
               # trainer.logprob_chunk_size null: the 32768-token budget) against chunks of 4 rows (the former default)
      for chunk in null 4; do
        timeout "$(left)" "$PY" -m rlbridge train recipes/quickstart-gpu.yaml --run-dir "$OUT/$part/$chunk" "${scale[@]}" \
          --set run.steps=4 --set trainer.max_tokens_per_micro_batch=32768 --set algorithm.kl.coef=0.05 \
          --set trainer.logprob_chunk_size=$chunk > "$OUT/$part/$chunk.log" 2>&1
        rm -rf "$OUT/$part/$chunk/checkpoints"
        grep -E "^step|^[0-9.]+s  \(" "$OUT/$part/$chunk.log" | tail -8
      done ;;
    gengap)
      timeout "$(left)" "$PY" bench/generation_gap.py --recipe recipes/quickstart-gpu.yaml --steps 4 "${scale[@]}" \
        --set rollout.weight_sync=merged --set rollout.ignore_eos=true --alone both --no-save > "$OUT/$part/log.txt" 2>&1
      tail -8 "$OUT/$part/log.txt" ;;
    update)
      for r in 16 0; do
        timeout "$(left)" "$PY" bench/update_padding.py --model qwen2.5-0.5b --device cuda --batch 512 --micro 32 \
          --max-tokens 32768 --lora-rank $r --warmup 1 --steps 2 --no-save > "$OUT/$part/rank$r.txt" 2>&1
        tail -6 "$OUT/$part/rank$r.txt"
      done ;;
    shared)
      timeout "$(left)" "$PY" bench/shared_prompts.py --device cuda --prompts 8 --n 4 --micro 4 --max-tokens 32768 --steps 5 --no-save \
        > "$OUT/$part/quickstart.txt" 2>&1
      tail -5 "$OUT/$part/quickstart.txt"
      for model in smollm2-135m qwen2.5-0.5b; do
        timeout "$(left)" "$PY" bench/shared_prompts.py --device cuda --model $model --prompts 64 --n 8 --micro 32 \
          --max-tokens 32768 --prompt-min 60 --prompt-max 200 --response-min 20 --response-max 256 --logprob-chunk 64 \
          --steps 3 --no-save > "$OUT/$part/$model-512.txt" 2>&1
        tail -5 "$OUT/$part/$model-512.txt"
      done ;;
    updatemeg)
      for r in 16 0; do
        timeout "$(left)" "$PY" bench/update_padding.py --engine megatron --model qwen2.5-0.5b --device cuda --batch 512 \
          --micro 32 --max-tokens 32768 --lora-rank $r --warmup 1 --steps 2 --no-save > "$OUT/$part/rank$r.txt" 2>&1
        tail -6 "$OUT/$part/rank$r.txt"
      done ;;
    trl|trlasync)
      extra=(); [ "$part" = trlasync ] && extra=(--also-async)
      timeout "$(left)" "$PY" bench/trl_grpo.py --recipe recipes/quickstart-gpu.yaml --steps "${TRL_STEPS:-10}" --warmup 2 \
        --rlbridge-set trainer.max_tokens_per_micro_batch=32768 --work "$OUT/$part/work" --no-save "${extra[@]}" \
        > "$OUT/$part/log.txt" 2>&1
      grep -E "^\[bench\]|step_s_median|rlbridge_over_trl\"|over_" "$OUT/$part/log.txt" | tail -14 ;;
    trl512|trl512async)
      extra=(); [ "$part" = trl512async ] && extra=(--also-async)
      timeout "$(left)" "$PY" bench/trl_grpo.py --recipe recipes/quickstart-gpu.yaml --steps 3 --warmup 1 \
        "${card[@]}" --set data.batch_size=64 --set rollout.n=8 --set rollout.max_response_tokens=256 \
        --rlbridge-set trainer.max_tokens_per_micro_batch=32768 --work "$OUT/$part/work" --no-save "${extra[@]}" \
        > "$OUT/$part/log.txt" 2>&1
      grep -E "^\[bench\]|step_s_median|rlbridge_over_trl\"|over_" "$OUT/$part/log.txt" | tail -14 ;;
    growth)
      timeout "$(left)" "$PY" bench/growth.py --recipe recipes/quickstart-gpu.yaml --steps 3 --device "one H200" \
        "${card[@]}" --set trainer.max_tokens_per_micro_batch=32768 --out "$OUT/$part/runs" --no-save > "$OUT/$part/log.txt" 2>&1
      grep -E "^\[growth\]" "$OUT/$part/log.txt" | tail -12 ;;
    growth2)
      timeout "$(left)" "$PY" bench/growth.py --recipe recipes/quickstart-gpu.yaml --steps 2 --device "one H200" \
        --batches 2048 --lengths 1024 --set trainer.max_tokens_per_micro_batch=32768 --out "$OUT/$part/runs" --no-save \
        > "$OUT/$part/log.txt" 2>&1
      grep -E "^\[growth\]" "$OUT/$part/log.txt" | tail -12 ;;
    spikes)
      mode=${SPIKES_MODE:-async}; run="$OUT/$part/run-$mode"
      sets=(--set run.steps=32 --set data.val=null --set trainer.max_tokens_per_micro_batch=32768)
      [ "$mode" = async ] && sets+=(--set rollout.mode=async --set rollout.max_staleness=1
        --set algorithm.rollout_correction.weights=token)
      nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 200 \
        > "$OUT/$part/$mode-gpu_util.csv" 2>/dev/null &
      smi=$!
      timeout "$(left)" "$PY" -m rlbridge train recipes/quickstart-gpu.yaml --run-dir "$run" "${sets[@]}" \
        > "$OUT/$part/$mode.log" 2>&1
      kill "$smi" 2>/dev/null
      cp "$run/metrics.jsonl" "$OUT/$part/$mode-metrics.jsonl"
      for f in "$run"/logs/*; do [ -f "$f" ] && cp "$f" "$OUT/$part/$mode-log-$(basename "$f")"; done
      rm -rf "$run"
      "$PY" - "$OUT/$part/$mode-metrics.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "train":
        t = {k[5:]: round(v, 2) for k, v in r.items() if k.startswith("time_") and v >= 0.005}
        print(r["step"], t, "trainer", round(r.get("trainer_update_s", -1), 2), "tokens", r["tokens"])
PYEOF
      ;;
    widths)
      for m in 1 16 32; do
        timeout "$(left)" "$PY" bench/sdpa_shapes.py --device cuda --width-multiple "$m" --no-save > "$OUT/$part/w$m.txt" 2>&1
        echo "-- pass_width_multiple $m"; grep -E "^update|_s\"|distinct" "$OUT/$part/w$m.txt"
      done ;;
    trlwidth)
      also=($(async_variant w16 trainer.pass_width_multiple=16))
      if [ "${TRLWIDTH_NOCUDNN:-0}" = 1 ]; then also+=($(async_variant nocudnn RLBRIDGE_CUDNN_ATTENTION=0)); fi
      trl_async "$part" "${also[@]}" ;;
    graphs)
      for g in "" --cuda-graphs; do
        # shellcheck disable=SC2086  # $g: no word, or the one flag
        timeout "$(left)" "$PY" bench/sdpa_shapes.py --device cuda --width-multiple 16 --no-profile $g --no-save \
          > "$OUT/$part/log${g:+-graphs}.txt" 2>&1
        grep -E "^update|_s\"|Error" "$OUT/$part/log${g:+-graphs}.txt" | tail -22
      done ;;
    rolloutstep)
      timeout "$(left)" "$PY" bench/rollout_step.py --recipe recipes/quickstart-gpu.yaml --steps 20 --no-save \
        > "$OUT/$part/log.txt" 2>&1
      grep -E "_median|_max|Error" "$OUT/$part/log.txt" | tail -12 ;;
    trlgraphs)
      trl_async "$part" $(async_variant graphs trainer.cuda_graphs=true) ;;
    ab|ab512)  # issue 47: bench/ab_rounds.py, rounds alternated under the part's budget, files flat in $OUT/$part
      if [ "$part" = ab ]; then
        args=(--rounds "${AB_ROUNDS:-3}" --steps "${AB_STEPS:-8}" --warmup 1)
      else
        args=("${at512[@]}" --rounds "${AB_ROUNDS:-2}")
      fi
      ab_rounds "$part" --recipe recipes/quickstart-gpu.yaml "${args[@]}" ;;
    abasync|abasync512)  # issue 47: async vs async, bench/ab_rounds.py --trl-async (bench/trl_async.py)
      if [ "$part" = abasync ]; then
        args=(--rounds "${AB_ROUNDS:-3}" --steps "${AB_STEPS:-8}" --warmup 1)
      else
        args=("${at512[@]}" --rounds "${AB_ROUNDS:-2}")
        # on an 80 GB card the plan refuses the fast recipe at 512 (trainer 60.5 GiB at 32768-token passes beside
        # vLLM's 0.3): vLLM at 0.22 for both tools, rlbridge's passes at 24576 tokens (74.4 GiB planned)
        [ ${#card[@]} -gt 0 ] && args+=(--set rollout.gpu_memory_utilization=0.22
                                        --rlbridge-set trainer.max_tokens_per_micro_batch=24576)
      fi
      ab_rounds "$part" --recipe recipes/quickstart-gpu-fast.yaml --trl-async "${args[@]}" ;;
    eqwall)  # issue 47 item 4: bench/equal_wall.py on the GPU quickstart, one seed per call (EQWALL_SEED, default 1),
             # EQWALL_S seconds of training per arm (default 90): TRL, rlbridge sync, rlbridge async
      timeout "$(left)" "$PY" bench/equal_wall.py --recipe recipes/quickstart-gpu.yaml --wall-s "${EQWALL_S:-90}" \
        --seeds "${EQWALL_SEED:-1}" --out "$OUT/$part" > "$OUT/$part/log.txt" 2>&1
      grep -E "^\[equal-wall\]|Error" "$OUT/$part/log.txt" | tail -8 ;;
    startgraphs)  # "before": rollout/vllm_compat.py without its compilation_config line (vLLM's default sizes)
      variants=$(mktemp -d)  # the two copies of the file stay off $OUT: they are source, not results
      sed 's/kwargs\["compilation_config"\] = .*/pass/' rlbridge/rollout/vllm_compat.py > "$variants/vllm_compat_default.py"
      cp rlbridge/rollout/vllm_compat.py "$variants/vllm_compat_run_sized.py"
      timeout "$(left)" "$PY" bench/startup_marks.py --recipe recipes/quickstart-gpu.yaml --rounds 3 \
        --file rlbridge/rollout/vllm_compat.py --variant "default=$variants/vllm_compat_default.py" \
        --variant "run-sized=$variants/vllm_compat_run_sized.py" --out "$OUT/$part/marks.json" > "$OUT/$part/log.txt" 2>&1
      tail -12 "$OUT/$part/log.txt" ;;
    compilestale)
      timeout "$(left)" "$PY" bench/compile_stale_check.py --device cuda --steps 3 > "$OUT/$part/log.txt" 2>&1
      grep -E "step [0-9]" "$OUT/$part/log.txt" ;;
    compile)
      for variant in "--dynamic --modes eager,default" "--dynamic --modes eager,reduce-overhead" "--modes eager,default"; do
        name=$(echo "$variant" | tr -c 'a-z0-9\n' '_')
        # shellcheck disable=SC2086  # the variant's words are separate arguments
        timeout "$(left)" "$PY" bench/compile_layers.py --device cuda --batch 32 --steps 8 --shapes 3 $variant --no-save \
          > "$OUT/$part/$name.txt" 2>&1
        tail -5 "$OUT/$part/$name.txt"
      done ;;
    passcost)
      timeout "$(left)" "$PY" bench/pass_cost.py --device cuda --rows 8 --response 76 --passes 8 --steps 3 --no-save \
        > "$OUT/$part/log.txt" 2>&1
      tail -6 "$OUT/$part/log.txt" ;;
    memory)
      for mb in 2 8; do for resp in 256 1024; do
        timeout "$(left)" "$PY" bench/trainer_gpu.py --attention sdpa --micro $mb --batch 8 --prompt 256 --response $resp \
          --warmup 1 --steps 3 --peak-reps 5 --jobs-per-gpu 4 --out "$OUT/$part/mb$mb-r$resp" \
          > "$OUT/$part/mb$mb-r$resp.txt" 2>&1
        tail -12 "$OUT/$part/mb$mb-r$resp.txt"
      done; done ;;
    engines2)  # issue 43 item 6: two vLLM engines on the GPU (gpu_memory_utilization 0.3 each) vs one, hf trainer beside
               # them, 512 rollouts/step of SmolLM2 (64 x 8, <= 256 tokens), both sleeping and waking every step;
               # bench/engines_per_device.py (two CLI runs per round, the same seed, samples compared token for token;
               # EPD_ARGS="--only 2": the 2-engine run alone)
      timeout "$(left)" "$PY" bench/engines_per_device.py --recipe recipes/quickstart-gpu.yaml --out "$OUT/$part" \
        --rounds "${EPD_ROUNDS:-1}" --steps "${EPD_STEPS:-4}" --warmup 1 --share 0.3 ${EPD_ARGS:-} \
        --set data.batch_size=64 --set rollout.n=8 --set rollout.max_response_tokens=256 --set rollout.sleep=always \
        > "$OUT/$part/log.txt" 2>&1
      grep -E "^round|^1 engine|Error|failed" "$OUT/$part/log.txt" | tail -12 ;;
    7bhf|7bmeg)  # issue 44: recipes/qwen2.5-7b-grpo-lora.yaml on one GPU through the CLI (bench/size7b.py), 5 steps of
                 # 32 x 8, <= 256 tokens, adapter checkpoint at step 5; the run stays in /tmp/rlb7b for 7bresume/7bexport
      engine=hf; [ "$part" = 7bmeg ] && engine=megatron
      timeout "$(left)" "$PY" bench/size7b.py train --engine $engine --steps "${STEPS7B:-5}" --save-every "${STEPS7B:-5}" --run-dir /tmp/rlb7b/$engine \
        --out "$OUT/$part" > "$OUT/$part/log.txt" 2>&1
      tail -30 "$OUT/$part/log.txt" ;;
    7bresume)  # after 7bhf on the same machine: resume to step 8, kill -9 once step 6 is logged, resume again
      timeout "$(left)" "$PY" bench/size7b.py resume --run-dir /tmp/rlb7b/${RUN7B:-hf} --kill-after-step 6 --steps 8 \
        --out "$OUT/$part" > "$OUT/$part/log.txt" 2>&1
      tail -20 "$OUT/$part/log.txt" ;;
    7bexport)  # export-hf --merge-lora of that run; vLLM (CUDA, bf16) vs float32 transformers log-probs of fixed texts
      rm -rf /tmp/rlb7b/merged  # a repeated export starts from an empty directory
      timeout "$(left)" "$PY" bench/size7b.py export --run-dir /tmp/rlb7b/${RUN7B:-hf} --export-dir /tmp/rlb7b/merged \
        --out "$OUT/$part" > "$OUT/$part/log.txt" 2>&1
      tail -12 "$OUT/$part/log.txt" ;;
    7bfit)  # issue 44 item 3: the largest token budget per pass validate-recipe accepts for ENGINE7B (default hf), one
            # step at it with every pass near the plan's worst case (must fit), the next multiple of 4096 refused
      timeout "$(left)" "$PY" bench/size7b.py fit --engine "${ENGINE7B:-hf}" --run-dir /tmp/rlb7b/fit --out "$OUT/$part" > "$OUT/$part/log.txt" 2>&1
      tail -16 "$OUT/$part/log.txt" ;;
    30b)  # issue 44 item 5: the 30B-A3B MoE recipe on one H200 with size7b.py's one-GPU overrides and the MoE recipe's own
          # (one node, pipeline and expert parallel 1, one mini-batch, vLLM at 0.45 of the device: the plan's fit)
          # and the adapter sync (the recipe's merged sync would write 57 GiB to /dev/shm beside vLLM's 57 GiB offload)
      # a second call on the same machine starts over unless the first one's run saved its checkpoint
      [ -n "$(ls /tmp/rlb30b/checkpoints 2>/dev/null)" ] && { echo "/tmp/rlb30b has a checkpoint: trained already"; continue; }
      rm -rf /tmp/rlb30b
      timeout "$(left)" "$PY" bench/size7b.py train --recipe recipes/qwen3-30b-a3b-moe-lora.yaml --model qwen3-30b-a3b-random \
        --engine "${ENGINE30B:-megatron}" --steps "${STEPS30B:-2}" --save-every "${STEPS30B:-2}" --run-dir /tmp/rlb30b \
        --set cluster.nodes=1 --set trainer.parallel.pipeline=1 --set trainer.parallel.expert=1 \
        --set data.mini_batch_size=32 --set rollout.gpu_memory_utilization=0.45 \
        --set rollout.weight_sync=adapter --set rollout.max_lora_rank=32 --out "$OUT/$part" > "$OUT/$part/log.txt" 2>&1
      tail -30 "$OUT/$part/log.txt" ;;
    mfu7b|mfu7btf32|plan7b)  # issue 44 item 2: the update's MFU at the 7B shape, LoRA (whole model) and full fine-tuning
            # (its first MFU7B_FULL_LAYERS layers, default 8: 63.5 GiB peak on an H100, mfu7b-gpu-2026-12-07; the whole
            # 7B's full fine-tuning does not fit one GPU), both engines, with a profile of each; two bench runs so that no job is one that
            # cannot fit. mfu7btf32: the same with CUDA float32 matmuls on TF32 tensor cores (the float32 output
            # layer: 23-52 % of the kernel time in mfu7b-gpu-2026-12-06), and the log-prob gap that makes.
            # plan7b (issue 44 item 3): the same jobs with trainer.recompute full, unprofiled: the plan vs the peaks
      precision=ieee; recompute=none; [ "$part" = mfu7btf32 ] && precision=tf32
      profile=--profile; [ "$part" = plan7b ] && { recompute=full; profile=; }
      full_layers=${MFU7B_FULL_LAYERS:-8}
      for job in "lora qwen2.5-7b" "full qwen2.5-7b:$full_layers"; do
        read -r mode model <<< "$job"
        # shellcheck disable=SC2086  # $profile: no word when empty
        timeout "$(left)" "$PY" bench/trainer_gpu.py --models "$model" --modes "$mode" --attention sdpa --batch "${MFU7B_BATCH:-16}" \
          --prompt 256 --response 256 --micro "${MFU7B_MICRO:-8}" --warmup 1 --steps 3 --peak-reps 20 $profile \
          --fp32-matmul "$precision" --recompute "$recompute" --out "$OUT/$part/$mode" > "$OUT/$part/$mode.txt" 2>&1
        tail -12 "$OUT/$part/$mode.txt"
      done ;;
    packed)  # issue 47 item 3's lever sized: the hf engine's train_step at 512 rollouts (64 prompts x 8) of GSM8K-like
             # lengths in its padded token-budget passes vs trainer.packed_passes (varlen attention), without and with
             # shared prompts, same weights, alternated (bench/packed_passes.py; its check first: log-probs, gradients)
      for model in ${PACKED_MODELS:-smollm2-135m qwen2.5-0.5b}; do
        # Qwen2.5-0.5B's 151k-vocabulary logits at 32768 tokens ran out of memory on an 80 GB card (2026-12-07)
        tokens=${PACKED_TOKENS:-$([ "$model" = qwen2.5-0.5b ] && [ ${#card[@]} -gt 0 ] && echo 16384 || echo 32768)}
        timeout "$(left)" "$PY" bench/packed_passes.py --model "$model" --device cuda --batch 512 --samples 8 \
          --max-tokens "$tokens" --warmup 1 --steps 3 --out "$OUT/$part/$model" > "$OUT/$part/$model.txt" 2>&1
        grep -A4 -E '"(step_s_median|speedup_vs_padded|check|passes)"' "$OUT/$part/$model.txt" | tail -30
      done ;;
    loradtype)  # the hf engine's LoRA update at the 7B shape (mfu7b's LoRA job, unprofiled) with its adapters in
                # float32 (peft's default) and in the model's bfloat16 with float32 masters (lora.compute_dtype
                # model), alternated, LORADTYPE_ROUNDS (default 2) rounds
      for round in $(seq "${LORADTYPE_ROUNDS:-2}"); do
        for dtype in float32 model; do
          timeout "$(left)" "$PY" bench/trainer_gpu.py --models qwen2.5-7b --modes lora --engines hf --attention sdpa \
            --batch "${MFU7B_BATCH:-16}" --prompt 256 --response 256 --micro "${MFU7B_MICRO:-8}" --warmup 1 --steps 3 \
            --peak-reps 20 --lora-dtype "$dtype" --out "$OUT/$part/$dtype-$round" > "$OUT/$part/$dtype-$round.txt" 2>&1
          grep -E "^done|\"(step_ms|mfu)\"" "$OUT/$part/$dtype-$round.txt" | tail -3
        done
      done ;;
    tf32ab)  # the float32 output layer on TF32 tensor cores vs exact float32 matmuls, the same jobs as mfu7b (unprofiled)
      full_layers=${MFU7B_FULL_LAYERS:-8}
      for mode in ${TF32AB_MODES:-full lora}; do
        model=qwen2.5-7b; [ "$mode" = full ] && model=qwen2.5-7b:$full_layers
        for head in tf32 ieee; do
          timeout "$(left)" "$PY" bench/trainer_gpu.py --models "$model" --modes "$mode" --attention sdpa --batch "${MFU7B_BATCH:-16}" \
            --prompt 256 --response 256 --micro "${MFU7B_MICRO:-8}" --warmup 1 --steps 3 --peak-reps 20 \
            --engines "${TF32AB_ENGINES:-megatron,hf}" --float32-head "$head" --out "$OUT/$part/$mode-$head" > "$OUT/$part/$mode-$head.txt" 2>&1
          grep -E "^done|\"(step_ms|mfu)\"" "$OUT/$part/$mode-$head.txt" | tail -6
        done
      done ;;
    *) echo "unknown part $part (smoke, engines2, async3, inloop, klpasses, gengap, update, updatemeg, passcost, memory, trl, trlasync, trl512, trl512async, growth, growth2, shared, compile, compilestale, 7bhf, 7bmeg, 7bresume, 7bexport, 7bfit, mfu7b, mfu7btf32, tf32ab, loradtype, packed, plan7b, 30b, ab, ab512, ab512pick, abasync, abasync512, eqwall, startgraphs)" >&2; exit 2 ;;
  esac
  [ "$(left)" -le 5 ] && { echo "budget spent after $part"; break; }
done
}

main "$@"
exit $?
