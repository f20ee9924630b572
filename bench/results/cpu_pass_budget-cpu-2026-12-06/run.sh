#!/bin/bash
cd /work/main
for round in 1 2; do
 for b in none 1024 512; do
  d=/tmp/s31/budget/r$round-$b; rm -rf $d; mkdir -p $d
  extra=(); [ $b != none ] && extra=(--set trainer.max_tokens_per_micro_batch=$b)
  timeout 600 .venv/bin/rlbridge train recipes/quickstart.yaml --run-dir $d/run --set run.steps=5 --set data.val=null "${extra[@]}" > $d/train.log 2>&1
  python3 -c "
import json,sys
rs=[json.loads(l) for l in open('$d/run/metrics.jsonl') if '\"step\"' in l and 'time_update' in l]
print('$round $b', 'upd', [round(r['time_update'],2) for r in rs], 'gen', [round(r['time_generate'],2) for r in rs], 'step', [round(r['time_step'],2) for r in rs])
" >> /tmp/s31/budget/summary.txt
 done
done
