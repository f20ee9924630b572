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
import zlib
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
    def __init__(
        self,
        logs_dir: Path,
        *,
        name: str,
        config: dict[str, Any],
        history: list[dict[str, Any]] | None = None,
    ) -> None:
        """history: the run's records so far (metrics.jsonl of a resumed run, cut back to its checkpoint); an
        offline run logs again those of them that no earlier offline run's file holds (see `backfill`)."""
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

        if history and mode() == "offline":
            self.backfilled = backfill(self.run, root, history)

    backfilled: list[int] = []
    """The steps logged again from metrics.jsonl at start (a resume after a kill; see `backfill`)."""

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


def _write_log(path: Path, header: bytes, records: list[bytes]) -> None:
    """A .wandb file of `records` in the format `_chunks` reads (crc32 seeded with the type byte, as wandb's
    writer does), written beside `path` and renamed into place."""
    out = bytearray(header)
    for body in records:
        first = True
        while True:
            left = _BLOCK - len(out) % _BLOCK
            if left < 7:
                out += b"\0" * left
                continue
            room = left - 7
            part, body = body[:room], body[room:]
            kind = (_FULL if not body else _FIRST) if first else (_LAST if not body else _MIDDLE)
            crc = zlib.crc32(part, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF
            out += struct.pack("<IHB", crc, len(part), kind) + part
            first = False
            if not body:
                break
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(out)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _step_of(rec: Any) -> int | None:
    """The step of a history record (None for other records)."""
    if rec.WhichOneof("record_type") != "history":
        return None
    for item in rec.history.item:
        if item.key == "_step":
            return int(json.loads(item.value_json))
    return int(rec.history.step.num)


def truncate_offline(wandb_dir: Path, step: int) -> int:
    """Drop the history rows of steps after `step` from every offline run under `wandb_dir`
    (RUN_DIR/logs/wandb/offline-run-*; a resume from checkpoint `step` recomputes them and logs them in a new
    offline run of the same id). Returns how many rows went. Online runs are the server's: W&B itself ignores
    a step below the run's current one, so there the killed attempt's rows stay (the same numbers after an
    exact resume; wall-clock timings aside)."""
    from wandb.proto import wandb_internal_pb2 as pb

    dropped = 0
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        kept, gone = [], 0
        for chunk in _chunks(data):
            rec = pb.Record()  # type: ignore[attr-defined]  # generated at runtime; no stubs
            rec.ParseFromString(chunk)
            s = _step_of(rec)
            if s is not None and s > step:
                gone += 1
            else:
                kept.append(chunk)
        if gone:
            _write_log(path, data[:_HEADER], kept)
            dropped += gone
    return dropped


def backfill(run: Any, root: Path, history: list[dict[str, Any]]) -> list[int]:
    """Log the records of `history` whose steps no earlier offline run under `root` holds; returns those steps.

    wandb writes an offline run's rows from a buffer of its own service process: a run killed with -9 loses
    the last rows it had logged (seen: a run killed a minute after its step-1 row had none of its rows on
    disk). The resume re-logs them from metrics.jsonl, the source of truth, before its first new step, so the
    offline runs together hold every step once. Online runs are not back-filled (the server's rows cannot be
    read here)."""
    current = Path(run.dir).parent.resolve() if getattr(run, "dir", None) else None
    have: set[int] = set()
    for d in root.glob("offline-run-*"):
        if d.resolve() == current or not any(d.glob("run-*.wandb")):
            continue
        try:
            have |= {int(row["_step"]) for row in read_history(d) if "_step" in row}
        except (OSError, ValueError):
            continue  # an unreadable earlier file: its rows are logged again rather than lost
    steps: list[int] = []
    for record in history:
        step = int(record.get("step", 0))
        if step not in have:
            run.log(scalars(record), step=step)
            if not steps or steps[-1] != step:
                steps.append(step)
    return steps
