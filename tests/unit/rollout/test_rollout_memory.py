"""The colocated-GPU sequencing (sleep during the update; wake weights, sync, then KV cache), in isolation.

The CUDA build of vLLM cannot run on these machines, so this checks the order of the calls the session
makes, with a recorder in place of the rollout worker; on real GPUs the sequence is unverified.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from rlbridge.rollout.memory import RolloutMemory, RolloutState


class Recorder:
    """The rollout client's sleep and wake-ups, recorded (and, with `delay`, taking that long)."""

    def __init__(self, delay: dict[str, float] | None = None) -> None:
        self.calls: list[tuple] = []
        self.delay = delay or {}

    def _record(self, method: str, *args: object) -> None:
        self.calls.append((method, *args))
        time.sleep(self.delay.get(method, 0.0))

    def sleep(self, level: int = 1) -> None:
        self._record("sleep", level)

    def wake_up(self, tags: list[str]) -> None:
        self._record("wake_up", tags)


def recorder() -> tuple[list[tuple], Any]:
    rec = Recorder()
    return rec.calls, rec


def test_step_sequence_wakes_weights_before_the_sync_and_kv_cache_after() -> None:
    calls, call = recorder()
    mem = RolloutMemory(call, enabled=True)
    for _ in range(2):  # two steps
        mem.release()
        mem.load(lambda: calls.append(("load_weights",)))
    assert calls == [("sleep", 1), ("wake_up", ["weights"]), ("load_weights",), ("wake_up", ["kv_cache"])] * 2
    assert mem.state is RolloutState.AWAKE


def test_first_sync_after_resume_sleeps_first() -> None:
    calls, call = recorder()
    mem = RolloutMemory(call, enabled=True)
    mem.load(lambda: calls.append(("load_weights",)))
    assert calls[0] == ("sleep", 1) and calls[2] == ("load_weights",)


def test_out_of_order_transitions_raise() -> None:
    _, call = recorder()
    mem = RolloutMemory(call, enabled=True)
    mem.release()
    with pytest.raises(RuntimeError, match="from state asleep"):
        mem.release()  # sleeping twice would lose track of what is resident


def test_disabled_on_cpu_calls_nothing() -> None:
    calls, call = recorder()
    mem = RolloutMemory(call, enabled=False)
    mem.release()
    assert mem.load(lambda: "loaded") == "loaded"
    assert calls == []


def test_sleep_and_wake_seconds_per_step() -> None:
    """sleep_s (inside time_update) and wake_s (both wake-ups, inside time_sync): issue 16 asks them <= 2 % of a
    step; the loop puts them in each train record."""
    slow = Recorder({"sleep": 0.01, "wake_up": 0.02})
    mem = RolloutMemory(slow, enabled=True)
    mem.release()
    mem.load(lambda: None)
    got = mem.take_seconds()
    assert set(got) == {"sleep_s", "wake_s"}
    assert 0.01 <= got["sleep_s"] < got["wake_s"]  # two wake-ups of 0.02 s each
    assert got["wake_s"] >= 0.04
    assert mem.take_seconds() == {}  # counted again from zero
    off = RolloutMemory(slow, enabled=False)  # CPU or separate devices: nothing sleeps, nothing to report
    off.release()
    off.load(lambda: None)
    assert off.take_seconds() == {}
