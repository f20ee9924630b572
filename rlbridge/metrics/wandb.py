"""Weights & Biases: online when WANDB_API_KEY is set, offline otherwise; files under RUN_DIR/logs/wandb.

Offline runs land in RUN_DIR/logs/wandb/offline-run-*/ and upload later with `wandb sync <that dir>`.
WANDB_MODE, WANDB_PROJECT and WANDB_ENTITY are honoured when set (WANDB_MODE=disabled turns it off). The
API key is read by wandb from the environment or ~/.netrc, never passed or written here; the run config
is the resolved recipe. The wandb run id is kept in RUN_DIR/logs/wandb/run-id, so a resumed run continues
the same wandb run.

`read_history` reads an offline run back without the network (wandb's public API needs the server): the
`.wandb` file is a LevelDB-style log of protobuf records; its history records hold what `run.log` got.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import wandb

from rlbridge.metrics.sinks import scalars


def mode() -> str:
    """offline without a key, so a run never blocks on a login prompt or the network."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def _new_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbSink:
    def __init__(self, logs_dir: Path, *, name: str, config: dict[str, Any]) -> None:
        root = logs_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else _new_id()
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rlbridge"),
            name=name,
            id=run_id,
            resume="allow",
            config=config,
            dir=str(logs_dir),
            mode=mode(),  # type: ignore[arg-type]  # wandb's stubs type mode as a Literal; mode() returns one of its values
            settings=wandb.Settings(
                console="off", silent=True, disable_git=True, save_code=False, x_disable_stats=True
            ),
        )

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


# ------------------------------------------------------------------------------------------ reading back
_HEADER = 7  # b":W&B" + magic 0xBEE1 (little-endian) + version byte
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> Iterator[bytes]:
    """Records of a LevelDB log (the .wandb format): 32 KiB blocks of [crc32 u32, length u16, type u8, data]."""
    if data[:4] != b":W&B":
        raise ValueError("not a .wandb file (missing the :W&B header)")
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            yield pending + body
        elif kind == 0 and length == 0:  # zero padding up to the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0


def read_records(run_dir: Path) -> list[Any]:
    """Every protobuf record (wandb_internal_pb2.Record) of an offline wandb run directory (`offline-run-*`)."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(run_dir.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {run_dir}")
    records = []
    for chunk in _chunks(files[0].read_bytes()):
        rec = pb.Record()  # type: ignore[attr-defined]  # protobuf classes are generated at runtime; no stubs
        rec.ParseFromString(chunk)
        records.append(rec)
    return records


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows `run.log` got, in order: [{'_step': .., 'train/reward_mean': .., ...}]."""
    return [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        for rec in read_records(run_dir)
        if rec.WhichOneof("record_type") == "history"
    ]


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run config (the resolved recipe) as logged: from the run record, then any config updates."""
    out: dict[str, Any] = {}
    for rec in read_records(run_dir):
        kind = rec.WhichOneof("record_type")
        updates = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    out.pop("_wandb", None)
    return out
