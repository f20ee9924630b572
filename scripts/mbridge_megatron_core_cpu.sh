#!/usr/bin/env bash
# The mbridge engine tests (tests/megatron/test_megatron_engine.py -k mbridge: Qwen2 at TP1 and TP2 x PP2, tied
# Llama at PP2, on gloo, against Hugging Face) with the GPU machine's Megatron stack (megatron-core 0.19.2,
# Megatron-Bridge 0.6.2, mbridge 0.15.1) on a CPU machine, without touching .venv:
#
#     bash scripts/mbridge_megatron_core_cpu.sh          # after `make setup`; ~4 min on 2 cores, downloads ~3 MB
#     CORE=0.17.1 bash scripts/mbridge_megatron_core_cpu.sh   # another megatron-core
#
# The three wheels (pure Python but for a dataset helper the tests do not load) are unpacked into an overlay
# directory put first on PYTHONPATH. megatron-core >= 0.17 declares Python >= 3.12 and has no cp311 wheel; its code
# runs on 3.11 except for `typing.override` (3.12), which the overlay's sitecustomize.py takes from
# typing_extensions. So this runs library versions outside their declared Python: a probe that the CPU machines
# can make in minutes, not a supported set-up; `tests/megatron/gpu_smoke.py --suite mbridge` on the GPU machine is
# the real check. Seen 2026-12-01 with megatron-core 0.19.2: 3 passed (without compat.mbridge_model_type():
# AttributeError: encoder_and_decoder in mbridge/core/util.py get_model).
set -euo pipefail
VENV=${VENV:-.venv}
CORE=${CORE:-0.19.2}
BRIDGE=${BRIDGE:-0.6.2}
MBRIDGE=${MBRIDGE:-0.15.1}
site=${SITE:-/tmp/rlbridge-overlay-mcore-$CORE-bridge-$BRIDGE-mbridge-$MBRIDGE}
py="$VENV/bin/python"
if [ ! -f "$site/.complete" ]; then
  rm -rf "$site" && mkdir -p "$site/wheels"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --ignore-requires-python \
    -d "$site/wheels" "megatron-core==$CORE" "megatron-bridge==$BRIDGE" "mbridge==$MBRIDGE" 2>&1 \
    | grep -v "^WARNING: Location" || true
  for wheel in "$site"/wheels/*.whl; do "$py" -m zipfile -e "$wheel" "$site"; done
  cat > "$site/sitecustomize.py" <<'PY'
# Python 3.12's typing.override for megatron-core >= 0.17 on 3.11 (scripts/mbridge_megatron_core_cpu.sh).
import typing

import typing_extensions

if not hasattr(typing, "override"):
    typing.override = typing_extensions.override
PY
  touch "$site/.complete"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "from importlib.metadata import version as v; print('overlay:', {d: v(d) for d in ('megatron-core', 'megatron-bridge', 'mbridge')})"
exec "$py" -m pytest -q tests/megatron/test_megatron_engine.py -k mbridge "$@"
