"""Engines sharing a device start one after another (rollout.engines_per_device, rlbridge/launch.py).

vLLM sizes its KV cache by profiling the device's memory and counts what another engine allocates on the same
device meanwhile as its own use: two engines starting together on one GPU left one of them "no available memory
for the cache blocks" (seen on an H100 at 0.3 each). So the second engine of a device is created only after the
first has started. `rlbridge train` on CPU with two engines on its one device: engine 1's start-up line counts
more seconds since the workers were asked for than engine 0's whole start, and the step trains.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from tests.fixtures.tiny_llama import build_tiny_llama
from tests.integration.test_resume import recipe, run, train_metrics

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

UP = re.compile(r"rollout engine (\d): .*?\((\d+\.\d) s: ray worker (\d+\.?\d*) s")


def test_engines_sharing_a_device_start_one_after_another(tmp_path: Path) -> None:
    r = recipe(build_tiny_llama(tmp_path / "model"))
    r["name"] = "engine-waves"
    r["rollout"]["engines_per_device"] = 2
    r["run"].update(steps=1, save_every=0)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(r))
    rc, out = run(["train", str(recipe_file), "--run-dir", str(tmp_path / "run")], tmp_path / "log.txt")
    assert rc == 0, out[-5000:]
    up = {int(m[1]): (float(m[2]), float(m[3])) for m in UP.finditer(out.replace("\n", " "))}
    assert set(up) == {0, 1}, out[-3000:]
    # engine 1's Ray worker was asked for only once engine 0 had started: all of engine 0's time lies
    # before engine 1's constructor ran
    assert up[1][1] >= up[0][0], up
    assert [x["step"] for x in train_metrics(tmp_path / "run")] == [1]
