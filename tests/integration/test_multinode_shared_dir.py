"""Multi-node preflight (issue 45): before any worker starts, every node proves it sees the run directory.

A real two-node Ray cluster on this machine (tests/fixtures/multinode.py) whose second node (node_b) runs in its
own mount namespace with an empty tmpfs mounted over one directory, HIDDEN: the driver and node_a see HIDDEN's
files, node_b sees an empty directory at the same path, as a host without the shared mount (or with a
node-local directory of that name) would. Needs root (CAP_SYS_ADMIN) for `unshare --mount`; skipped otherwise.

- `check_shared_run_dir` (rlbridge/cluster/ray_cluster/placement.py), called in a process joined to the cluster: a run
  directory outside HIDDEN passes on both nodes and leaves no file behind; one inside HIDDEN is refused naming
  node_b (its Ray node id), what it could not do, and the fix;
- `rlbridge train` with `--run-dir` inside HIDDEN on the two nodes: exit 1 in seconds, that message without a
  traceback, and no worker started (the workers' log files are absent).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.multinode import RAY_ENV, TwoNodeCluster, two_node_cluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]
HIDDEN = Path(f"/tmp/rlbridge-node-local-{os.getpid()}")
HIDE = (
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount -t tmpfs tmpfs "$0" && exec "$@"',
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodeCluster]:
    HIDDEN.mkdir()
    probe = subprocess.run([*HIDE, str(HIDDEN), "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        HIDDEN.rmdir()
        pytest.skip(f"cannot give a node its own mount namespace (needs root): {probe.stderr.strip()}")
    try:
        yield from two_node_cluster(num_cpus=1, worker_prefix=(*HIDE, str(HIDDEN)))
    finally:
        subprocess.run(["rm", "-rf", str(HIDDEN)])


def env() -> dict[str, str]:
    return {**os.environ, **RAY_ENV, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "COLUMNS": "200"}


CHECK = """
import json, sys, ray
from rlbridge.cluster import ray_cluster as rc
from rlbridge.errors import RlbridgeError
ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False, configure_logging=False)
said = []
try:
    rc.check_shared_run_dir(sys.argv[2], rc.alive_nodes(), said.append)
    print(json.dumps({"ok": said}))
except RlbridgeError as e:
    print(json.dumps({"refused": str(e)}))
"""


def check(cluster: TwoNodeCluster, run_dir: Path) -> dict[str, object]:
    res = subprocess.run(
        [sys.executable, "-c", CHECK, cluster.address, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
        cwd=ROOT,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def node_b_id(cluster: TwoNodeCluster) -> str:
    return next(n["id"] for n in cluster.alive_nodes() if "node_b" in n["resources"])


def test_a_shared_run_dir_passes_and_a_node_local_one_is_refused_naming_the_node(
    cluster: TwoNodeCluster, tmp_path: Path
) -> None:
    shared = tmp_path / "run"
    shared.mkdir()
    assert check(cluster, shared) == {"ok": [f"run directory {shared}: seen by all 2 nodes"]}
    assert list(shared.iterdir()) == []  # the token and the replies are removed

    local = HIDDEN / "run"
    local.mkdir()
    refused = str(check(cluster, local)["refused"])
    print(refused)
    assert refused.startswith(
        f"the run directory {local} is not shared with every node: the driver wrote .node-check-"
    )
    assert f"(ray node {node_b_id(cluster)[:8]})" in refused and "cannot read it (No such file" in refused
    assert "(ray node" in refused and refused.count("ray node") == 1  # node_a (the head) is not named
    assert "put it on a filesystem all nodes mount at the same path" in refused and "--run-dir DIR" in refused
    assert list(local.iterdir()) == []


def test_train_refuses_before_any_worker_starts(cluster: TwoNodeCluster) -> None:
    run = HIDDEN / "train-run"
    start = time.monotonic()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbridge",
            "train",
            "recipes/smoke-megatron-cpu.yaml",
            "--set",
            "rollout.engine=hf",
            "--set",
            "trainer.parallel.pipeline=1",
            "--set",
            "data.val=null",
            "--set",
            f"cluster.address={cluster.address}",
            "--set",
            "cluster.nodes=2",
            "--set",
            "cluster.gpus_per_node=1",
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
        cwd=ROOT,
    )
    took = time.monotonic() - start
    out = " ".join((res.stdout + res.stderr).split())
    print(f"refused in {took:.0f} s: {out[out.find('the run directory') :][:600]}")
    assert res.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert f"the run directory {run} is not shared with every node" in out, out[-3000:]
    assert f"(ray node {node_b_id(cluster)[:8]})" in out
    assert "starting the trainer and rollout workers" not in out
    assert not [p.name for p in (run / "logs").glob("*") if p.name.startswith(("trainer", "rollout"))]
