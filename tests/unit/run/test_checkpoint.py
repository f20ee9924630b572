"""The checkpoint format: atomic saves, completeness checks, retention, RNG and recipe checks on resume."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbridge.errors import RlbridgeError
from rlbridge.run import checkpoint as ck
from rlbridge.run import resume_policy as policy
from rlbridge.run import rng

RECIPE = "name: t\nlora: {rank: 16, alpha: 32}\nrun: {steps: 10, seed: 1, keep: 3}\n"


def tensors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(4, 6, generator=g)
    return {
        "trainable": {
            "layer.0.lora_A": torch.randn(2, 6, generator=g, dtype=torch.float32).to(torch.bfloat16),
            "layer.0.lora_B": torch.randn(6, 2, generator=g),
            "tied.a": base,
            "tied.b": base[1:3],  # a view sharing storage with tied.a
            "transposed": base.t(),  # non-contiguous, same storage again
            "empty": torch.empty(0, 3),
        },
        "optimizer": {
            "layer.0.lora_B:step": torch.tensor(7, dtype=torch.int64),
            "layer.0.lora_B:exp_avg": torch.randn(6, 2, generator=g, dtype=torch.float64),
        },
    }


def save(run_dir: Path, step: int, *, keep: int = 3, seed: int = 0, **kw: object) -> Path:
    return ck.save_checkpoint(
        run_dir,
        step,
        tensors=tensors(seed),
        state={"data": {"index": step}},
        recipe_yaml=RECIPE,
        keep=keep,
        **kw,
    )  # type: ignore[arg-type]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def step_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    src = tensors()
    state = {"data": {"epoch": 1, "index": 3}, "rng": rng.rng_state(), "weight_version": 5, "metrics": [0.5]}
    path = ck.save_checkpoint(tmp_path, 12, tensors=src, state=state, recipe_yaml=RECIPE, keep=2)
    assert path == tmp_path / "checkpoints" / "step_000012"
    loaded = ck.load_checkpoint(path)
    assert loaded.step == 12 and loaded.state == state and loaded.recipe_yaml == RECIPE
    assert loaded.tensors.keys() == src.keys()
    for group, named in src.items():
        assert loaded.tensors[group].keys() == named.keys()
        for name, t in named.items():
            got = loaded.tensors[group][name]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(raw(got), raw(t)), name  # bit-exact, NaN payloads and -0.0 included
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["versions"]["torch"] == importlib.metadata.version("torch")
    assert set(manifest["files"]) == {
        "trainable.safetensors",
        "optimizer.safetensors",
        "state.json",
        "recipe.yaml",
    }
    assert manifest["recipe_sha256"] == manifest["files"]["recipe.yaml"]["sha256"]
    assert ck.verify_checkpoint(path) is None
    assert step_dirs(tmp_path) == ["step_000012"]  # no temp dirs left


def test_crash_before_manifest_leaves_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = save(tmp_path, 10)

    def crash(tmp: Path, manifest: dict[str, object]) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ck, "_write_manifest", crash)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 20, seed=1)
    assert step_dirs(tmp_path) == ["step_000010"]
    assert ck.verify_checkpoint(good) is None
    assert ck.latest_complete(tmp_path, log=lambda m: None) == ck.CheckpointInfo(10, good, None)


def test_crash_replacing_same_step_keeps_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save(tmp_path, 10)
    real_rename = os.rename

    def rename(src: object, dst: object) -> None:
        if str(src).endswith(f"-{os.getpid()}") and ".tmp-" in str(src):
            raise OSError("crash during rename")
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(ck.os, "rename", rename)
    with pytest.raises(OSError):
        save(tmp_path, 10, seed=1)
    monkeypatch.setattr(ck.os, "rename", real_rename)
    assert step_dirs(tmp_path) == ["step_000010"]
    assert torch.equal(
        ck.load_checkpoint(path).tensors["trainable"]["tied.a"], tensors(0)["trainable"]["tied.a"]
    )
    save(tmp_path, 10, seed=1)  # a successful replace
    assert step_dirs(tmp_path) == ["step_000010"]
    assert torch.equal(
        ck.load_checkpoint(path).tensors["trainable"]["tied.a"], tensors(1)["trainable"]["tied.a"]
    )


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_manifest(path: Path, edit: object) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)  # type: ignore[operator]
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (
            lambda p: (p / "trainable.safetensors").write_bytes(
                (p / "trainable.safetensors").read_bytes()[:-9]
            ),
            r"trainable.safetensors: size \d+ bytes, manifest says \d+ \(truncated",
        ),
        (lambda p: _flip_byte(p / "optimizer.safetensors", -3), r"optimizer.safetensors: sha256 mismatch"),
        (lambda p: (p / "manifest.json").unlink(), r"no manifest.json \(save interrupted\?\)"),
        (lambda p: (p / "manifest.json").write_text("{"), r"manifest.json is not valid JSON"),
        (lambda p: (p / "trainable.safetensors").unlink(), r"missing trainable.safetensors"),
        (
            lambda p: _edit_manifest(p, lambda m: m["files"]["state.json"].update(sha256="0" * 64)),
            r"state.json: sha256 mismatch",
        ),
        (lambda p: _edit_manifest(p, lambda m: m.update(step=99)), r"manifest.json says step 99"),
        (
            lambda p: _edit_manifest(p, lambda m: m["files"].pop("optimizer.safetensors")),
            r"optimizer.safetensors: not listed in manifest.json",
        ),
        (
            lambda p: _edit_manifest(p, lambda m: m["files"].update({"../x": {"size": 1, "sha256": ""}})),
            r"outside the checkpoint",
        ),
    ],
)
def test_damage_is_detected_and_skipped(tmp_path: Path, damage: object, reason: str) -> None:
    good = save(tmp_path, 10)
    bad = save(tmp_path, 20, seed=1)
    damage(bad)  # type: ignore[operator]
    problem = ck.verify_checkpoint(bad)
    assert problem is not None and re.search(reason, problem), problem
    messages: list[str] = []
    assert ck.latest_complete(tmp_path, log=messages.append) == ck.CheckpointInfo(10, good, None)
    assert len(messages) == 1 and "step_000020" in messages[0] and problem in messages[0]
    with pytest.raises(RlbridgeError, match="not complete"):
        ck.load_checkpoint(bad)


def test_non_finite_tensor_is_refused_and_nothing_written(tmp_path: Path) -> None:
    save(tmp_path, 10)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    bad = tensors()
    bad["trainable"]["layer.0.lora_A"][0, 0] = float("nan")
    bad["optimizer"]["layer.0.lora_B:exp_avg"][1] = float("inf")
    with pytest.raises(RlbridgeError) as info:
        ck.save_checkpoint(tmp_path, 20, tensors=bad, state={}, recipe_yaml=RECIPE, keep=1)
    msg = str(info.value)
    assert "trainable/layer.0.lora_A (1 of 12" in msg and "optimizer/layer.0.lora_B:exp_avg (2 of 12" in msg
    assert "Nothing was written" in msg
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_retention_keeps_the_newest_complete(tmp_path: Path) -> None:
    logged: list[str] = []
    for step in (10, 20, 30, 40):
        save(tmp_path, step, keep=2, log_fn=logged.append)
    assert step_dirs(tmp_path) == ["step_000030", "step_000040"]
    assert logged == ["deleted step_000010 (run.keep=2)", "deleted step_000020 (run.keep=2)"]
    # a broken newer checkpoint is neither counted nor deleted; the newest good one survives keep=1
    (tmp_path / "checkpoints" / "step_000040" / "manifest.json").unlink()
    save(tmp_path, 35, keep=1)
    assert step_dirs(tmp_path) == ["step_000035", "step_000040"]
    infos = ck.list_checkpoints(tmp_path)
    assert [(i.step, i.complete) for i in infos] == [(35, True), (40, False)]


def test_stale_tmp_dirs_are_removed(tmp_path: Path) -> None:
    save(tmp_path, 10)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    root = tmp_path / "checkpoints"
    (root / f".tmp-step_000020-{dead_pid}").mkdir()
    (root / f".tmp-step_000020-{dead_pid}" / "trainable.safetensors").write_bytes(b"partial")
    (root / f".tmp-step_000030-{os.getppid()}").mkdir()  # owned by a live process: left alone
    (root / f".old-step_000005-{dead_pid}").mkdir()  # a replace interrupted between renames: restored
    save(tmp_path, 20, keep=5)
    assert step_dirs(tmp_path) == [
        f".tmp-step_000030-{os.getppid()}",
        "step_000005",
        "step_000010",
        "step_000020",
    ]


def test_rng_round_trip_reproduces_draws() -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in the python state
    state = json.loads(json.dumps(rng.rng_state()))

    def draws() -> tuple[list[float], list[float], list[float]]:
        return (
            [random.random(), random.gauss(0, 1)],
            np.random.standard_normal(3).tolist(),
            torch.randn(3).tolist(),
        )

    first = draws()
    draws()
    rng.set_rng_state(state)
    assert draws() == first
    with pytest.raises(RlbridgeError, match="invalid RNG state"):
        rng.set_rng_state({"python": state["python"]})


NEW = (
    "name: t\nlora: {rank: 32, alpha: 32}\nrun: {steps: 20, seed: 1, keep: 3, eval_every: 5}\ndata: {x: 1}\n"
)


def test_recipe_diff_and_resume_compatibility() -> None:
    assert policy.recipe_diff(RECIPE, RECIPE) == []
    assert policy.recipe_diff(RECIPE, NEW) == [
        ("lora.rank", 16, 32),
        ("run.steps", 10, 20),
        ("run.eval_every", policy.MISSING, 5),
        ("data", policy.MISSING, {"x": 1}),
    ]
    assert policy.recipe_diff("a: 1", "a: 1.0") == [] and policy.recipe_diff("a: 1", "a: true") == [
        ("a", 1, True)
    ]
    problems = policy.check_resume_compatible(RECIPE, NEW)
    assert len(problems) == 2
    assert (
        problems[0].startswith("lora.rank changed from 16 to 32")
        and "Set lora.rank back to 16" in problems[0]
    )
    assert problems[1].startswith('data changed from (absent) to {"x": 1}')
    assert policy.check_resume_compatible(RECIPE, RECIPE.replace("steps: 10", "steps: 50")) == []
    assert policy.is_resume_safe("run.health.max_skips") and not policy.is_resume_safe("run.seed")
    assert not policy.is_resume_safe("run.stepsize")


@pytest.mark.parametrize(
    "rel", ["", "..", "../x", "a/../../x", "/etc/passwd", "a/../..", "C:/x", "\\\\srv\\x", "link/x", "link"]
)
def test_safe_join_refuses_escapes(tmp_path: Path, rel: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(RlbridgeError, match="refusing path"):
        ck.safe_join(root, rel)


def test_safe_join_accepts_inside_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "inner").symlink_to(tmp_path / "sub")
    assert ck.safe_join(tmp_path, "a/b.safetensors") == tmp_path / "a" / "b.safetensors"
    assert ck.safe_join(tmp_path, "inner/x.json") == tmp_path / "inner" / "x.json"


def test_no_pickle_in_checkpoint_module() -> None:
    source = Path(ck.__file__).read_text(encoding="utf-8")
    assert "torch.load" not in source and "pickle" not in source


def test_a_key_added_by_a_later_version_resumes_at_its_default() -> None:
    """A checkpoint written before rollout.engines_per_device existed resumes when the key is at its default (1),
    not when it is set to something else; a key the schema does not know is still refused."""
    old = "name: t\nrollout: {n: 4}\n"
    assert policy.schema_default("rollout.engines_per_device") == 1
    assert policy.schema_default("trainer.optim.betas") == [0.9, 0.999]
    assert policy.schema_default("no.such.key") is policy.MISSING
    assert policy.check_resume_compatible(old, "name: t\nrollout: {n: 4, engines_per_device: 1}\n") == []
    [problem] = policy.check_resume_compatible(old, "name: t\nrollout: {n: 4, engines_per_device: 2}\n")
    assert problem.startswith("rollout.engines_per_device changed from (absent) to 2")
    [problem] = policy.check_resume_compatible(old, "name: t\nrollout: {n: 4, made_up: 1}\n")
    assert problem.startswith("rollout.made_up changed from (absent) to 1")
