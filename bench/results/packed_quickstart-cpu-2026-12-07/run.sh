cd /work/main
for r in 1 2; do
  for v in default packshared; do
    extra=""; [ $v = packshared ] && extra="--set trainer.packed_passes=true --set trainer.shared_prompts=always"
    rm -rf /tmp/pk/run-$v-$r
    timeout 600 .venv/bin/python -m rlbridge train recipes/quickstart.yaml --run-dir /tmp/pk/run-$v-$r --set run.steps=7 --set data.val=null $extra > /tmp/pk/$v-$r.log 2>&1
    cp /tmp/pk/run-$v-$r/metrics.jsonl /tmp/pk/$v-$r.metrics.jsonl; rm -rf /tmp/pk/run-$v-$r
  done
done
echo done > /tmp/pk/DONE
