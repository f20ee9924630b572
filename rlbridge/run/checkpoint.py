"""The on-disk checkpoint format: complete or absent, never half-written; safetensors and JSON only.

A checkpoint is a flat directory `RUN_DIR/checkpoints/step_XXXXXX/`:

    <group>.safetensors   one per tensor group (e.g. trainable, optimizer), safetensors only
    state.json            JSON-able run state: data position, RNG states, weight version, scheduler, metrics
    recipe.yaml           the resolved recipe the run was trained with
    manifest.json         written LAST: step, recipe sha256, library versions, created time, and the size
                          and sha256 of every other file

Users of other frameworks report auto-resume picking a half-written checkpoint, NaN weights saved and then
retention deleting the last healthy checkpoint, and resumes silently changing the recipe
(USER_REPORTS.md, section E). This module removes those failure modes in one place, without knowing which
engine produced the tensors:

- a save is written to `.tmp-step_XXXXXX-<pid>`, fsynced, and renamed into place, so `step_*` directories
  only ever appear whole; a crash leaves a `.tmp-*` directory that the next save removes;
- a checkpoint is *complete* only when its manifest parses and every listed file matches its size and
  sha256 (`verify_checkpoint`); `latest_complete` skips newer broken ones and says why;
- non-finite tensors are refused before anything is written, and retention never deletes the newest
  complete checkpoint (nor a broken one newer than it: it is left for the user to inspect);

Which recipe changes a resume accepts is resume_policy.py's; the RNG states it stores come from process.py.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlbridge import faults
from rlbridge.errors import RlbridgeError
from rlbridge.run.process import pid_alive

log = logging.getLogger(__name__)

FORMAT = "rlbridge-checkpoint/1"
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.json"
RECIPE = "recipe.yaml"
TENSOR_SUFFIX = ".safetensors"
VERSIONED_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "vllm",
    "megatron-core",
    "megatron-bridge",
    "ray",
    "safetensors",
    "numpy",
    "rlbridge-cli",  # this project's distribution (PyPI's `rlbridge` is another project)
)
"""Distributions whose versions go into the manifest (looked up, never imported)."""

_STEP_DIR = re.compile(r"step_(\d{6,})")
_LEFTOVER_DIR = re.compile(r"\.(tmp|old)-(step_\d{6,})-(\d+)")
_GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_NUM_NAMED = 5  # offending tensors named in an error message


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    problem: str | None
    """None when complete, else why not (see `verify_checkpoint`)."""

    @property
    def complete(self) -> bool:
        return self.problem is None


@dataclass
class Loaded:
    path: Path
    step: int
    tensors: dict[str, dict[str, torch.Tensor]]
    """Group name -> tensor name -> tensor (on CPU)."""
    state: dict[str, Any]
    manifest: dict[str, Any]
    recipe_yaml: str


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ---------------------------------------------------------------------------------------------- saving
def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    state: Mapping[str, Any],
    recipe_yaml: str,
    keep: int,
    log_fn: Callable[[str], None] = log.info,
) -> Path:
    """Write `checkpoints/step_XXXXXX` atomically and apply retention; returns its path.

    `tensors` maps a group name to its tensors, each group written as `<group>.safetensors`. Raises
    RlbridgeError, with nothing written, when a tensor holds NaN/inf. A checkpoint already at this step is
    replaced. Afterwards the oldest complete checkpoints beyond `keep` and stale `.tmp-*` directories of dead
    processes are deleted (`log_fn` reports each deletion).
    """
    if step < 0 or keep < 1:
        raise ValueError(f"step must be >= 0 and keep >= 1 (got step={step}, keep={keep})")
    _check_groups(tensors)
    _check_finite(step, tensors)
    state_json = json.dumps(dict(state), indent=1)  # fails here, before anything is written
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for group, named in tensors.items():
            save_file(_prepare(named), str(tmp / f"{group}{TENSOR_SUFFIX}"), metadata={"format": "pt"})
        faults.pause("checkpoint-files")  # tests kill -9 here (rlbridge/faults.py); a no-op otherwise
        _write_bytes(tmp / STATE, state_json.encode())
        _write_bytes(tmp / RECIPE, recipe_yaml.encode())
        _write_manifest(tmp, _manifest(tmp, step))
        _fsync_path(tmp)
        final = _publish(tmp, root / step_dir_name(step))
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_disk_full(e):
            raise RlbridgeError(_disk_full_message(root, step, e)) from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_leftovers(root, log_fn)
    _apply_retention(root, keep, log_fn)
    return final


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT, as an OSError or as safetensors' SafetensorError (which wraps the OS error in text)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(e)
    return type(e).__name__ == "SafetensorError" and any(
        s in text
        for s in (f"os error {errno.ENOSPC})", f"os error {errno.EDQUOT})", "No space left on device")
    )


def _disk_full_message(root: Path, step: int, e: BaseException) -> str:
    try:
        free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free now"
    except OSError:
        free = "free space unknown"
    done = [i.step for i in list_checkpoints(root.parent, hashes=False) if i.complete]
    kept = (
        f"the newest complete checkpoint, {step_dir_name(done[-1])}, is untouched"
        if done
        else "there is no earlier complete checkpoint"
    )
    return (
        f"disk full: no space left on the device of {root} while saving checkpoint step {step} "
        f"({getattr(e, 'strerror', None) or e}; {free}). The partial save was removed, nothing of step {step} was kept; {kept}"
    )


def _check_groups(tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    for group, named in tensors.items():
        if not _GROUP_NAME.fullmatch(group) or group.endswith(TENSOR_SUFFIX):
            raise ValueError(f"tensor group name {group!r} is not a plain file name ([A-Za-z0-9_.-])")
        bad = [name for name, t in named.items() if not isinstance(t, torch.Tensor)]
        if bad:
            raise TypeError(f"group {group!r}: not tensors: {bad[:_NUM_NAMED]}")


def _check_finite(step: int, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    bad: list[str] = []
    for group, named in tensors.items():
        for name, t in named.items():
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                count = int((~torch.isfinite(t)).sum())
                bad.append(f"{group}/{name} ({count} of {t.numel()} values NaN/inf)")
    if bad:
        shown = ", ".join(bad[:_NUM_NAMED]) + (
            f" and {len(bad) - _NUM_NAMED} more" if len(bad) > _NUM_NAMED else ""
        )
        raise RlbridgeError(
            f"refusing to save checkpoint step {step}: non-finite values in {len(bad)} "
            f"tensor(s): {shown}. Nothing was written; earlier checkpoints are untouched"
        )


def _prepare(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that own their storage (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named.items():
        t = tensor.detach().to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        storage = t.untyped_storage()
        if t.numel() and (storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size()):
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _manifest(tmp: Path, step: int) -> dict[str, Any]:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()
    }
    return {
        "format": FORMAT,
        "step": step,
        "recipe_sha256": files[RECIPE]["sha256"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "created_unix": time.time(),
        "python": sys.version.split()[0],
        "versions": library_versions(),
        "files": files,
    }


def _write_manifest(tmp: Path, manifest: dict[str, Any]) -> None:
    _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())


def _publish(tmp: Path, final: Path) -> Path:
    """Rename `tmp` to `final`; an existing `final` is moved aside first and deleted after."""
    root = final.parent
    old = root / f".old-{final.name}-{os.getpid()}"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.rename(old, final)
        raise
    _fsync_path(root)
    if old.exists():
        shutil.rmtree(old)
    return final


def library_versions() -> dict[str, str]:
    """Installed versions of VERSIONED_PACKAGES, from package metadata (nothing is imported)."""
    out: dict[str, str] = {}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ------------------------------------------------------------------------------------------- retention
def _remove_leftovers(root: Path, log_fn: Callable[[str], None]) -> None:
    """Delete `.tmp-*` dirs of crashed saves; restore an `.old-*` dir whose replacement never landed."""
    for path in sorted(root.iterdir()):
        m = _LEFTOVER_DIR.fullmatch(path.name)
        if not m or not path.is_dir() or pid_alive(int(m.group(3))):
            continue
        kind, final = m.group(1), root / m.group(2)
        if kind == "old" and not final.exists():
            os.rename(path, final)
            log_fn(f"restored {final.name} from {path.name} (a save replacing it was interrupted)")
            continue
        shutil.rmtree(path, ignore_errors=True)
        log_fn(f"removed {path.name} (left by an interrupted save)")


def _apply_retention(root: Path, keep: int, log_fn: Callable[[str], None]) -> None:
    """Keep the newest `keep` complete checkpoints; delete every checkpoint older than the oldest kept.

    Broken checkpoints newer than that are left alone (resume reports them). The check here is the cheap one
    (sizes, not hashes): hashing every kept checkpoint at every save would read them all again.
    """
    infos = list_checkpoints(root.parent, hashes=False)
    complete = [i for i in infos if i.complete]
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep].step
    for info in infos:
        if info.step < oldest_kept:
            shutil.rmtree(info.path)
            log_fn(f"deleted {info.path.name} (run.keep={keep})")


# -------------------------------------------------------------------------------------- verify, list, load
def verify_checkpoint(path: Path, *, hashes: bool = True) -> str | None:
    """None if `path` is a complete checkpoint, else the reason it is not.

    Complete: manifest.json parses, every file it lists is present with the listed size and (when `hashes`)
    sha256, state.json and recipe.yaml are listed, and no tensor file is unlisted.
    """
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    manifest, problem = _read_manifest(path)
    if problem:
        return problem
    m = _STEP_DIR.fullmatch(path.name)
    if m and int(m.group(1)) != manifest["step"]:
        return f"{MANIFEST} says step {manifest['step']} but the directory is {path.name}"
    files: dict[str, Any] = manifest["files"]
    for name in (STATE, RECIPE):
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    if files[RECIPE].get("sha256") != manifest.get("recipe_sha256"):
        return f"{MANIFEST}: recipe_sha256 does not match the listed {RECIPE}"
    for name, entry in files.items():
        problem = _check_file(path, name, entry, hashes)
        if problem:
            return problem
    unlisted = sorted(p.name for p in path.glob(f"*{TENSOR_SUFFIX}") if p.name not in files)
    return f"{unlisted[0]}: not listed in {MANIFEST}" if unlisted else None


def _read_manifest(path: Path) -> tuple[dict[str, Any], str | None]:
    file = path / MANIFEST
    if not file.is_file():
        return {}, f"no {MANIFEST} (save interrupted?)"
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        return {}, f"{MANIFEST} is not valid JSON ({e})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return {}, f"{MANIFEST} is not an {FORMAT} manifest"
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("files"), dict):
        return {}, f"{MANIFEST} is malformed (step or files missing)"
    if not all(isinstance(e, dict) for e in manifest["files"].values()):
        return {}, f"{MANIFEST} is malformed (a file entry is not an object)"
    return manifest, None


def _check_file(root: Path, name: str, entry: dict[str, Any], hashes: bool) -> str | None:
    try:
        file = safe_join(root, name)
    except RlbridgeError:
        return f"{MANIFEST} lists a file outside the checkpoint: {name!r}"
    if name == MANIFEST:
        return f"{MANIFEST} lists itself"
    if not file.is_file():
        return f"missing {name}"
    size = file.stat().st_size
    if size != entry.get("size"):
        return f"{name}: size {size} bytes, manifest says {entry.get('size')} (truncated or overwritten?)"
    if hashes and _sha256(file) != entry.get("sha256"):
        return f"{name}: sha256 mismatch"
    return None


def list_checkpoints(run_dir: Path, *, hashes: bool = True) -> list[CheckpointInfo]:
    """Every `checkpoints/step_*` directory of `run_dir`, oldest first, with its problem (None: complete)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    infos = [
        CheckpointInfo(int(m.group(1)), p, verify_checkpoint(p, hashes=hashes))
        for p in root.iterdir()
        if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()
    ]
    return sorted(infos, key=lambda i: i.step)


def latest_complete(run_dir: Path, *, log: Callable[[str], None] = print) -> CheckpointInfo | None:
    """The newest complete checkpoint; each newer broken one is reported through `log` and skipped."""
    for info in reversed(list_checkpoints(run_dir)):
        if info.complete:
            return info
        log(f"skipping checkpoint {info.path}: {info.problem}")
    return None


def load_checkpoint(path: Path) -> Loaded:
    """Verify, then load a checkpoint (tensors on CPU). Raises RlbridgeError if it is not complete."""
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem:
        raise RlbridgeError(f"checkpoint {path} is not complete: {problem}")
    manifest, _ = _read_manifest(path)
    tensors = {
        name[: -len(TENSOR_SUFFIX)]: load_file(str(path / name))
        for name in sorted(manifest["files"])
        if name.endswith(TENSOR_SUFFIX)
    }
    return Loaded(
        path=path,
        step=manifest["step"],
        tensors=tensors,
        state=json.loads((path / STATE).read_text(encoding="utf-8")),
        manifest=manifest,
        recipe_yaml=(path / RECIPE).read_text(encoding="utf-8"),
    )


# ---------------------------------------------------------------------------------------------- paths
def safe_join(root: Path, rel: str) -> Path:
    """`root / rel`, refusing a `rel` that is empty, absolute, contains `..`, or resolves (through
    symlinks) outside `root`."""
    pure = PurePosixPath(rel)
    if (
        not rel
        or "\x00" in rel
        or pure.is_absolute()
        or rel.startswith("\\")
        or ".." in pure.parts
        or re.match(r"[A-Za-z]:", rel)
    ):
        raise RlbridgeError(f"refusing path {rel!r}: it must be relative and stay inside {root}")
    path = Path(root) / rel
    base = Path(root).resolve()
    resolved = path.resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise RlbridgeError(f"refusing path {rel!r}: it resolves to {resolved}, outside {base}")
    return path
