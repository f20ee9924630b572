#!/usr/bin/env bash
# Build .gpu_site/pytest/: pytest and the little it needs, for the GPU machine (Python 3.12, no pytest there).
#
#   bash scripts/gpu_pytest_site.sh          # on the CPU machine, from the project root (~10 s, ~4 MB)
#
# Pure-Python wheels (plus psutil's abi3 wheel) for Python 3.12, unzipped, so that
# PYTHONPATH=/tmp/site:.gpu_site/pytest:$PWD makes `python -m pytest` work there (scripts/gpu_check.sh sets it).
# The versions are the CPU venv's, so the GPU run collects the tests as `make test` does. What the GPU machine
# already has and pytest needs: packaging (transformers needs it). pygments comes along (pytest >= 8.4 needs it;
# rich on the machine has its own, an extra copy is harmless); psutil: the kill/resume test looks for leftover
# processes with it (Ray's wheel does not bring it).
# .gpu_site/ is ignored (.git/info/exclude). NOTE: ../shared/gpu/pack_site.sh starts with `rm -rf .gpu_site`:
# run this script after it, not before.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qxF "/.gpu_site/" .git/info/exclude 2>/dev/null || echo "/.gpu_site/" >> .git/info/exclude
wheels=(pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0 pygments==2.21.0 psutil==7.2.2)
work=$(mktemp -d /tmp/gpu_pytest_site.XXXX)
trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work" "${wheels[@]}" 2>&1 | { grep -v "^WARNING: Location" || true; }
rm -rf .gpu_site/pytest
mkdir -p .gpu_site/pytest
for w in "$work"/*.whl; do
  python3 -m zipfile -e "$w" .gpu_site/pytest/
done
# a check that needs no GPU: this folder alone must give a working pytest (here under the local python3)
PYTHONPATH=.gpu_site/pytest python3 -c "import pytest, pluggy, iniconfig, pytest_timeout, psutil, pygments; print('pytest', pytest.__version__, 'from', pytest.__file__)" \
  || echo "note: the local python3 could not import the folder (psutil's binary is built for the GPU machine's Python 3.12 abi3; fine)"
du -sh .gpu_site/pytest
