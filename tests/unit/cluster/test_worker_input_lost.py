"""A worker whose input died with the worker producing it (real Ray, local): the consumer's error is InputLost,
and asking the producer for the same reference gives the producer's own "worker died" error, which names it.

What the weight sync relies on when a trainer dies while exporting (session.sync_weights): without it the user
read "rollout worker failed: ActorUnavailableError(...)" about a healthy rollout (seen in the two-node test
when node_b, holding the trainer, was killed during a sync).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from rlbridge.cluster.ray_cluster import InputLost, Worker
from rlbridge.errors import RlbridgeError


@ray.remote(num_cpus=0)
class Producer:
    def slow(self) -> int:
        time.sleep(60)
        return 1


@ray.remote(num_cpus=0)
class Consumer:
    def take(self, value: int) -> int:
        return value + 1


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_lost_input_is_named_by_its_producer(local_ray: Any) -> None:
    producer = Worker("trainer", Producer.remote())  # type: ignore[attr-defined]  # ray.remote's class
    consumer = Worker("rollout", Consumer.remote())  # type: ignore[attr-defined]  # ray.remote's class
    ref = producer.submit("slow")
    pending = consumer.submit("take", ref)
    time.sleep(1.0)  # the producer is inside slow()
    ray.kill(producer.handle, no_restart=True)
    with pytest.raises(InputLost, match="rollout worker could not get its input"):
        consumer.wait(pending, timeout=60)
    with pytest.raises(RlbridgeError, match="trainer worker died") as died:
        producer.wait(ref, timeout=60)
    assert not isinstance(died.value, InputLost)
    assert consumer.call("take", 1, timeout=60) == 2  # the consumer itself is fine
