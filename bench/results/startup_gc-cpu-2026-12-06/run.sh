#!/bin/bash
cd /work/main
for round in 1; do
 for v in 0 1; do  # RLBRIDGE_GC_PAUSE: a toggle of the measured code only (removed)
  d=/tmp/gcab/r$round-$v; rm -rf $d; mkdir -p $d
  s=$(date +%s.%N)
  RLBRIDGE_GC_PAUSE=$v timeout 600 .venv/bin/rlbridge train recipes/quickstart.yaml --run-dir $d/run --set run.steps=1 --set data.val=null > $d/train.log 2>&1
  e=$(date +%s.%N)
  up=$(grep -o "vLLM engine up ([0-9.]* s" $d/train.log | grep -o "[0-9.]*")
  tr=$(grep -o "model loaded ([0-9.]* s" $d/train.log | grep -o "[0-9.]*")
  st=$(python3 -c "import json;print([round(json.loads(l)['time_step'],2) for l in open('$d/run/metrics.jsonl') if 'time_step' in l])")
  gcs=$(grep -h "gc_pauses" $d/run/logs/rollout.log | wc -l)
  echo "$round $v wall=$(python3 -c "print(round($e-$s,1))") vllm_up=$up trainer=$tr step=$st gc_logged=$gcs" >> /tmp/gcab/summary.txt
 done
done
