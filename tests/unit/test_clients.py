"""The driver talks to its workers through typed clients (trainer/client.py, rollout/client.py), never by method
names as strings; read from the source, so the rule holds without starting a worker."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from rlbridge.rollout.base import RolloutEngine, SleepingRolloutEngine
from rlbridge.rollout.client import LocalRollout, RayRollout, RolloutClient
from rlbridge.rollout.group import RolloutGroup
from rlbridge.trainer.client import LocalTrainer, RayTrainer, Trainer

PKG = Path(__file__).resolve().parents[2] / "rlbridge"
BY_NAME = re.compile(r"""\.(call|submit)\(\s*["']""")
"""A Ray worker's method named by a string literal: `worker.call("generate", ...)`."""


def test_no_worker_method_is_named_by_a_string_outside_cluster() -> None:
    found = [
        f"{path.relative_to(PKG)}:{i}: {line.strip()}"
        for path in sorted(PKG.rglob("*.py"))
        if not path.relative_to(PKG).as_posix().startswith("cluster/")
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if BY_NAME.search(line)
    ]
    assert not found, "call the typed client's method instead:\n" + "\n".join(found)
    assert BY_NAME.search('rollout.call("generate", ids)') and BY_NAME.search("w.submit('join', 1)")


def public(cls: type) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_each_client_implements_how_its_calls_travel() -> None:
    """The interfaces hold the calls; a client only says how they reach the worker (nothing left abstract)."""
    for interface, clients in (
        (RolloutClient, (RayRollout, LocalRollout, RolloutGroup)),
        (Trainer, (RayTrainer, LocalTrainer)),
    ):
        for client in clients:
            assert issubclass(client, interface) and not client.__abstractmethods__, client  # type: ignore[attr-defined]
    assert {"generate", "send_generate", "load_weights", "send_load_weights", "sleep", "wake_up"} <= public(
        RolloutClient
    )


def test_the_rollout_client_sends_only_methods_the_engines_have() -> None:
    """RolloutClient names RolloutEngine's and SleepingRolloutEngine's methods by reference: every one is the
    engines' (vllm and hf load, generate; vllm sleeps and wakes)."""
    source = inspect.getsource(RolloutClient)
    sent = set(re.findall(r"(?:Sleeping)?RolloutEngine\.(\w+)", source))
    assert sent == {"generate", "load_weights", "sleep", "wake_up"}
    assert sent <= public(SleepingRolloutEngine) and {"generate", "load_weights"} <= public(RolloutEngine)
