"""The trainer's measured GPU peak against the plan's estimate (health.memory_notice): one line after the first
step, one warning the first time a step's peak exceeds the estimate by more than 15 %, nothing off CUDA."""

from __future__ import annotations

import re

import pytest

from rlbridge.health import memory_notice
from rlbridge.model.info import read_model_info
from rlbridge.plan import make_plan
from rlbridge.recipe import load_recipe
from rlbridge.trainer.role import device_memory_peaks


def test_first_step_line_then_one_warning_when_the_plan_is_exceeded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = load_recipe("recipes/quickstart-gpu.yaml")
    plan = make_plan(r, read_model_info(r.model.path))
    assert plan.memory is not None
    est = plan.memory.trainer_total
    told: set[str] = set()
    for step, peak in enumerate([0.5 * est, 0.6 * est, 1.3 * est, 1.4 * est, 0.5 * est], start=1):
        memory_notice(plan, {"step": step, "trainer_gpu_gib_max": peak}, told)
    text = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert re.findall(r"step (\d+): trainer GPU memory", text) == ["1", "3"], text
    assert (
        f"peak {0.5 * est:.2f} GiB allocated ({0.5 * est:.2f} reserved); the plan estimated {est:.2f}" in text
    )
    assert "the plan underestimates this run's trainer memory" in text
    memory_notice(plan, {"step": 1}, set())  # no CUDA figure (a CPU run): nothing
    assert capsys.readouterr().err == ""


def test_no_device_peaks_off_cuda() -> None:
    assert device_memory_peaks() == {}  # the CPU suite never initializes CUDA
