"""RLBRIDGE_PROFILE_UPDATE (trainer/profile.py): the named update of a real hf trainer role is profiled, the
others are not, and a bad value is a clear error."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from rlbridge.errors import RlbridgeError
from rlbridge.trainer import profile
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.unit.trainer.test_trainer_role import batch, role


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_the_named_update_is_profiled(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profile.PROFILE_ENV, f"{tmp_path / 'prof'}#2")
    t = role(tiny)
    b, adv, lp = batch()
    t.update(b, adv, lp, None)
    assert t.profiler.written is None and not (tmp_path / "prof").exists()
    t.update(b, adv, lp, None)
    text = t.profiler.written
    assert text is not None and text.name.startswith("update-2-")
    summary = text.read_text()
    assert summary.startswith("update 2 (pid ")
    # the spans of the update, each with its seconds: the role's and the hf engine's
    for span in ("train_step", "layout", "pass_batch", "forward", "loss", "backward", "optimizer", "gate"):
        assert f"rlbridge.{span} " in summary, span
    assert "by host time:" in summary and "aten::" in summary
    trace = json.loads(gzip.open(text.with_suffix(".json.gz")).read())
    assert any(e.get("name") == "rlbridge.train_step" for e in trace["traceEvents"])
    t.update(b, adv, lp, None)  # the 3rd: not profiled, the file stays the 2nd's
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == sorted(
        [text.name, text.with_suffix(".json.gz").name]
    )


@pytest.mark.parametrize("value", ["#2", "d#0", "d#x"])
def test_a_bad_value_names_the_variable(value: str) -> None:
    with pytest.raises(RlbridgeError, match="RLBRIDGE_PROFILE_UPDATE=.*expected DIR or DIR#N"):
        profile.parse(value)


def test_the_default_update_is_the_third() -> None:
    assert profile.parse("d") == (Path("d"), 3) and profile.parse(" ") is None


def test_device_busy_counts_kernels_copies_and_memsets_only() -> None:
    """The spans' device annotations cover the kernels they contain: counting them too would pass 100 %."""
    trace = {
        "traceEvents": [
            {"cat": "kernel", "dur": 300.0},
            {"cat": "gpu_memcpy", "dur": 50.0},
            {"cat": "gpu_memset", "dur": 5.0},
            {"cat": "gpu_user_annotation", "name": "rlbridge.forward", "dur": 400.0},
            {"cat": "cpu_op", "dur": 900.0},
            {"cat": "Trace"},
        ]
    }
    assert profile.device_busy_s(trace) == pytest.approx(355e-6, abs=1e-12)
