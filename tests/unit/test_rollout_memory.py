"""The colocated-GPU sequencing (sleep during the update; wake weights, sync, then KV cache), in isolation.

The CUDA build of vLLM cannot run on these machines, so this checks the order of the calls the session
makes, with a recorder in place of the rollout worker; on real GPUs the sequence is unverified.
"""

from __future__ import annotations

import pytest

from rlbridge.rollout.memory import RolloutMemory, RolloutState


def recorder() -> tuple[list[tuple], object]:
    calls: list[tuple] = []
    return calls, lambda method, *args: calls.append((method, *args))


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
