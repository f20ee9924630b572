"""Which devices generate and which train, with GPUs declared to a local Ray on CPU (issue 18 item 2).

Ray hands out declared GPUs like real ones: it assigns ids and sets CUDA_VISIBLE_DEVICES in each actor, which is
what puts vLLM and the trainer on their devices on a real machine. The session's own placement code
(ray_cluster.reserve / placement / start_worker, session.rollout_slot, the plan's bundles) places probe actors
for a megatron plan of 2 trainer GPUs: with `cluster.colocate: false` and `rollout.gpus: 1` the rollout gets a third
GPU of its own; colocated, it shares rank 0's. The workers' start-up answer carries their GPU ids (printed on the
start-up line on GPUs: "rollout: vLLM engine up on GPU 2 (...)").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.placement_group import remove_placement_group

from rlbridge.cluster import ray_cluster as rc
from rlbridge.model.info import read_model_info
from rlbridge.plan import make_plan
from rlbridge.recipe.load import load_recipe
from rlbridge.session import rollout_slot


class Probe:
    def where(self) -> tuple[list[str], str | None]:
        return [str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def declared_gpus() -> Iterator[None]:
    here = Path(__file__).parent  # the workers import Probe from this file
    path = os.pathsep.join([str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(
        address="local",
        num_cpus=3,
        num_gpus=3,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


def place(tmp: Path, *sets: str) -> tuple[list[list[str]], list[str], list[str]]:
    """(each trainer rank's GPU ids, the rollout's, the plan's bundle line) for the megatron GPU plan."""
    r = load_recipe(
        "recipes/quickstart-gpu.yaml",
        ["trainer.engine=megatron", "trainer.parallel.tensor=2", "cluster.gpus_per_node=2", *sets],
    )
    plan = make_plan(r, read_model_info(r.model.path))
    bundles = [b for node in plan.bundles_per_node for b in node] + plan.rollout_bundles
    pg = rc.reserve(bundles, timeout_s=60, log=print)
    try:
        where = rc.placement(pg, len(bundles) - len(plan.rollout_bundles))
        share = 0.5 if plan.colocate else 1.0
        workers = [
            rc.start_worker(
                Probe, name, pg, slot, num_cpus=share, num_gpus=share, log_file=tmp / f"{name}.log"
            )
            for name, slot in [
                *((f"trainer rank {i}", s) for i, s in enumerate(where.slots)),
                ("rollout", rollout_slot(plan, where)),
            ]
        ]
        started = [w.wait(w.send_started(), timeout=120) for w in workers]
        seen = [w.call("where", timeout=60) for w in workers]
        for w in workers:
            w.kill()
    finally:
        remove_placement_group(pg)
    for answer, (ids, visible) in zip(started, seen, strict=True):
        assert answer.gpus == ids and len(ids) == 1 and visible == ids[0], (answer, ids, visible)
    ids = [s[0] for s in seen]
    return ids[:-1], ids[-1], [f"{len(plan.rollout_bundles)} rollout bundle(s)", str(plan.bundles_per_node)]


def test_separate_devices_generate_on_a_gpu_of_their_own(tmp_path: Path, declared_gpus: Any) -> None:
    trainer, rollout, plan = place(tmp_path, "cluster.colocate=false", "rollout.gpus=1")
    assert plan[0] == "1 rollout bundle(s)", plan
    assert len({g[0] for g in trainer}) == 2, trainer  # two trainer ranks, two devices
    assert rollout[0] not in {g[0] for g in trainer}, (trainer, rollout)


def test_colocated_rollout_shares_rank_0s_gpu(tmp_path: Path, declared_gpus: Any) -> None:
    trainer, rollout, plan = place(tmp_path, "cluster.colocate=true")
    assert plan[0] == "0 rollout bundle(s)", plan
    assert len({g[0] for g in trainer}) == 2, trainer
    assert rollout == trainer[0], (trainer, rollout)
