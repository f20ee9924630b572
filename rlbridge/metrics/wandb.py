"""Weights & Biases: online when WANDB_API_KEY is set, offline otherwise; files under RUN_DIR/logs/wandb.

Offline runs land in RUN_DIR/logs/wandb/offline-run-*/ and upload later with `wandb sync <those dirs>` (in
order). Project, entity, run name and tags come from the recipe (`run.wandb`); WANDB_PROJECT, WANDB_ENTITY,
WANDB_NAME and WANDB_TAGS override them when set, and WANDB_MODE is honoured (disabled turns it off). The API
key is read by wandb from the environment or ~/.netrc, never passed or written here; the run config is the
resolved recipe.

The wandb run id is kept in RUN_DIR/logs/wandb/run-id. A resumed run (`rlbridge resume`) continues that run
with W&B's own rewind, `resume_from="<id>?_step=<N>"`: the history after step N is dropped by W&B (by the
server online; at `wandb sync` for offline runs, whose run record carries the branch point) and logging
continues at N + 1, so the steps the resume recomputes show once, with their new values. N is the
checkpoint's step, or, offline, one before the first step the earlier offline files lack (wandb buffers rows
in its service process: a kill -9 can lose the last ones); the resume logs the steps from N + 1 up to the
checkpoint again from metrics.jsonl. Where W&B refuses the rewind (a server without it), the run continues
with `resume="allow"` and says so; steps below W&B's current one are then dropped by W&B.

`read_history` reads an offline run back without the network (wandb's public API needs the server): the
`.wandb` file is a LevelDB-style log of protobuf records; its history records hold what `run.log` got.
`synced_history` replays the offline runs as `wandb sync` gives them to the server, rewinds included.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import wandb

from rlbridge.errors import RlbridgeError
from rlbridge.metrics.sinks import scalars
from rlbridge.recipe.schema import WandbCfg


def mode() -> str:
    """offline without a key, so a run never blocks on a login prompt or the network."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def _new_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def identity(cfg: WandbCfg, default_name: str) -> dict[str, Any]:
    """project, entity, name and tags for wandb.init: the recipe's, each overridden by its environment variable."""
    env = os.environ
    tags = env["WANDB_TAGS"].split(",") if env.get("WANDB_TAGS") else list(cfg.tags)
    return {
        "project": env.get("WANDB_PROJECT") or cfg.project,
        "entity": env.get("WANDB_ENTITY") or cfg.entity,
        "name": env.get("WANDB_NAME") or cfg.name or default_name,
        "tags": [t.strip() for t in tags if t.strip()],
    }


def _steps_held(root: Path) -> set[int]:
    """The steps the offline runs under `root` hold rows for (an unreadable file holds none)."""
    have: set[int] = set()
    for d in root.glob("offline-run-*"):
        if not any(d.glob("run-*.wandb")):
            continue
        try:
            have |= {int(row["_step"]) for row in read_history(d) if "_step" in row}
        except (OSError, ValueError):
            continue  # its rows are logged again rather than lost
    return have


def rewind_step(root: Path, history: list[dict[str, Any]], offline: bool) -> int:
    """The step a resumed run rewinds to: the newest step of `history` (the checkpoint's), or offline one before
    the first of its steps that no earlier offline file holds. -1: nothing to keep."""
    steps = sorted({int(r.get("step", 0)) for r in history})
    if not steps:
        return -1
    if not offline:
        return steps[-1]
    have = _steps_held(root)
    missing = [s for s in steps if s not in have]
    return steps[-1] if not missing else missing[0] - 1


class WandbSink:
    def __init__(
        self,
        logs_dir: Path,
        *,
        name: str,
        config: dict[str, Any],
        history: list[dict[str, Any]] | None = None,
        cfg: WandbCfg | None = None,
        warn: Callable[[str], None] = print,
    ) -> None:
        """history: the run's records so far (metrics.jsonl of a resumed run, cut back to its checkpoint); a
        resumed run rewinds the wandb run to it (see the module docstring). name: the run directory's name, the
        run name unless run.wandb.name or WANDB_NAME says otherwise. warn: where a refused rewind is told."""
        root = logs_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run-id"
        resumed = id_file.is_file() and bool(history)
        run_id = id_file.read_text().strip() if id_file.is_file() else _new_id()
        id_file.write_text(run_id + "\n")
        offline = mode() == "offline"
        self.rewound_to = rewind_step(root, history or [], offline) if resumed else -1
        """The step the wandb run was rewound to (-1: a new run, or nothing kept)."""
        kwargs: dict[str, Any] = dict(
            **identity(cfg or WandbCfg(), name),
            config=config,
            dir=str(logs_dir),
            mode=mode(),
            settings=wandb.Settings(
                console="off", silent=True, disable_git=True, save_code=False, x_disable_stats=True
            ),
        )
        backfill = resumed
        if self.rewound_to >= 0:
            try:
                self.run = init_when_free(
                    run_id, lambda: wandb.init(resume_from=f"{run_id}?_step={self.rewound_to}", **kwargs)
                )
            except RlbridgeError:
                raise
            except Exception as e:  # a server without rewind: continue the run as it is
                warn(
                    f"warning: W&B refused to rewind run {run_id} to step {self.rewound_to} ({e!r}); continuing it"
                )
                backfill = False
                self.run = init_when_free(run_id, lambda: wandb.init(id=run_id, resume="allow", **kwargs))
        else:  # a new run, or (offline) a resume whose earlier files kept no step: all of them are logged again
            self.run = init_when_free(run_id, lambda: wandb.init(id=run_id, resume="allow", **kwargs))
        self.backfilled: list[int] = []
        """The steps logged again from metrics.jsonl at start: those after the rewind step up to the checkpoint
        (offline: the rows a kill lost)."""
        for record in (history or []) if backfill else []:
            step = int(record.get("step", 0))
            if step > self.rewound_to:
                self.run.log(scalars(record), step=step)
                if not self.backfilled or self.backfilled[-1] != step:
                    self.backfilled.append(step)

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


IN_USE_WAIT_S = 60.0
"""How long a resume waits for W&B to let go of its run (see init_when_free)."""


def init_when_free(run_id: str, init: Callable[[], Any], wait_s: float | None = None) -> Any:
    """`init()`, retried while W&B answers that the run id "is in use": after a kill -9 the killed process's wandb
    service can still hold the run for a while (it outlives its parent until it notices), and a resume started
    at once is refused. Past `wait_s` (IN_USE_WAIT_S) the refusal is an RlbridgeError saying what to do."""
    limit = IN_USE_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + limit
    delay = 0.5
    while True:
        try:
            return init()
        except Exception as e:
            if "is in use" not in str(e):
                raise
            if time.monotonic() + delay > deadline:
                raise RlbridgeError(
                    f"W&B run {run_id} is still held by another wandb process (the killed run's service?) after "
                    f"{limit:.0f} s: wait for it to exit (`pgrep -af wandb`) "
                    "and resume again, or resume with WANDB_MODE=disabled"
                ) from e
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


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
    """Drop the history rows of steps after `step` from every offline run under `wandb_dir` (its files
    rewritten). Not used by a resume (it rewinds with W&B's resume_from); the tests use it to reproduce the
    rows a kill -9 loses. Returns how many rows went."""
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


def synced_history(root: Path) -> list[dict[str, Any]]:
    """The history the offline runs under `root` give W&B when synced in order (run directories are named by
    their start time): a run that rewinds (resume_from, its run record's branch point at step N) first drops
    the rows after N. What the W&B page of the run shows after `wandb sync`."""
    rows: list[dict[str, Any]] = []
    for d in sorted(root.glob("offline-run-*")):
        if not any(d.glob("run-*.wandb")):
            continue
        for rec in read_records(d):
            if rec.WhichOneof("record_type") == "run" and rec.run.branch_point.run:
                branch = int(rec.run.branch_point.value)
                rows = [r for r in rows if int(r.get("_step", 0)) <= branch]
        rows += read_history(d)
    return rows
