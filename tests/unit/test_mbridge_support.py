"""`trainer.bridge: mbridge` against the installed megatron-core: refused at validation when megatron-core has
dropped what mbridge needs (>= 0.17), from package metadata alone (no torch, no megatron imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlbridge.engines.megatron import support
from rlbridge.errors import RecipeError
from rlbridge.recipe import validate_recipe

QWEN7B = str(Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "qwen2.5-7b-instruct")
RECIPE = {
    "name": "t",
    "model": {"path": QWEN7B, "dtype": "bfloat16"},
    "trainer": {"engine": "megatron", "bridge": "mbridge", "parallel": {"tensor": 2}, "micro_batch_size": 2},
    "rollout": {"engine": "vllm", "n": 4, "tensor_parallel": 2, "max_prompt_tokens": 512, "max_response_tokens": 512},
    "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 8},
    "reward": {"fn": "arithmetic"},
    "cluster": {"nodes": 1, "gpus_per_node": 8},
}


def installed(monkeypatch: pytest.MonkeyPatch, **versions: str | None) -> None:
    """Pretend these distributions are installed (megatron_core=..., mbridge=...; None: not installed)."""
    table = {k.replace("_", "-"): v for k, v in versions.items()}
    monkeypatch.setattr(support, "installed_version", lambda dist: table.get(dist))


def issues(tmp_path: Path, *sets: str) -> list[tuple[str, str, str]]:
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(RECIPE))
    try:
        validate_recipe(f, sets)
    except RecipeError as e:
        return [(i.key, i.message, i.fix or "") for i in e.issues]
    return []


def test_version_tuple() -> None:
    assert support.version_tuple("0.19.2") == (0, 19, 2)
    assert support.version_tuple("0.16.0rc1") == (0, 16, 0)
    assert support.version_tuple("0.17") == (0, 17)
    assert support.version_tuple(None) == (0,)
    assert support.version_tuple("0.16.1") < support.version_tuple("0.17.0") < support.version_tuple("0.19.2")


@pytest.mark.parametrize(("core", "mbridge", "refused"), [
    ("0.16.1", "0.15.1", False),  # the CPU machines' stack: mbridge runs (tests/megatron)
    ("0.16.0", "0.15.1", False),
    ("0.17.0", "0.15.1", True),  # the release that removed ModelType.encoder_and_decoder
    ("0.18.2", "0.15.1", True),
    ("0.19.2", "0.15.1", True),  # the GPU machine's megatron-core
    ("0.19.2", None, True),  # mbridge not installed here: the megatron-core fact still holds
    ("0.19.2", "0.16.0", False),  # a newer mbridge than the one checked: no known reason to refuse
    (None, "0.15.1", False),  # no megatron-core here: the recipe may be meant for another machine
])
def test_mbridge_problem(monkeypatch: pytest.MonkeyPatch, core: str | None, mbridge: str | None, refused: bool) -> None:
    installed(monkeypatch, megatron_core=core, mbridge=mbridge)
    problem = support.mbridge_problem()
    assert (problem is not None) == refused
    if refused:
        assert "encoder_and_decoder" in str(problem) and f"megatron-core {core}" in str(problem)


def test_validate_refuses_mbridge_on_megatron_core_0_19(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    installed(monkeypatch, megatron_core="0.19.2", mbridge="0.15.1")
    found = issues(tmp_path)
    assert [k for k, _, _ in found] == ["trainer.bridge"], found
    _, message, fix = found[0]
    assert "megatron-core 0.17 removed" in message and "0.19.2" in message
    assert "trainer.bridge: megatron-bridge" in fix and "megatron-core<=0.16.1" in fix
    assert issues(tmp_path, "trainer.bridge=megatron-bridge") == []  # the fix it names works
    assert issues(tmp_path, "trainer.engine=hf", "trainer.parallel.tensor=1", "cluster.gpus_per_node=1",
                  "rollout.tensor_parallel=1") == []  # the bridge is not used by the hf engine


def test_validate_accepts_mbridge_on_megatron_core_0_16(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    installed(monkeypatch, megatron_core="0.16.1", mbridge="0.15.1")
    assert issues(tmp_path) == []
    found = issues(tmp_path, "lora.rank=16")  # the LoRA refusal is a separate rule, still in force
    assert [(k, "no LoRA" in m) for k, m, _ in found] == [("trainer.bridge", True)]


def test_engine_gate_says_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine refuses with the same reason (compat.features reads support too)."""
    from rlbridge.engines.megatron import compat

    installed(monkeypatch, megatron_core="0.19.2", mbridge="0.15.1")
    assert compat.features().mbridge_compatible is False
    installed(monkeypatch, megatron_core="0.16.1", mbridge="0.15.1")
    assert compat.features().mbridge_compatible is (compat.versions()["mbridge"] is not None)


def test_the_check_imports_nothing_heavy(tmp_path: Path) -> None:
    """validate-recipe of an mbridge recipe stays light: torch and megatron are not imported."""
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(RECIPE))
    code = (
        "import sys, json\n"
        "from rlbridge.recipe import validate_recipe\n"
        "from rlbridge.errors import RecipeError\n"
        f"try:\n    validate_recipe({str(f)!r})\nexcept RecipeError:\n    pass\n"
        "print(json.dumps(sorted(m for m in ('torch', 'megatron', 'mbridge', 'transformers') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
