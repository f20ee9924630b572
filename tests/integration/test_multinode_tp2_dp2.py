"""Megatron at tensor 2 x data 2 on two Ray nodes of two CPUs each (tests/fixtures/multinode.py): four gloo
ranks, two per node. Ray may interleave the placement group's bundles over the nodes; rlbridge orders the
devices node by node, so each tensor-parallel pair sits on one node and data parallelism crosses the nodes. The
plan's four colocated rollout engines run two on each node, engine i on rank i's node (the node each engine's
actor reports). The steps' rollouts (rollout_sha) and numbers equal the single-node run of the same layout
(cluster.nodes 1 x gpus_per_node 4, a local Ray, four engines too).

Four ranks and a rollout on this machine's two cores: the slowest multi-node test; the cheaper ones (one rank
per node, bad input, a lost node, resume) are in test_multinode.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.multinode import TwoNodeCluster, two_node_cluster
from tests.integration.test_multinode import env, rlbridge, train_records  # noqa: F401 (env: a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 2
TP2_DP2 = [
    "recipes/smoke-megatron-cpu.yaml",
    "--set",
    f"run.steps={STEPS}",
    "--set",
    "rollout.engine=hf",
    "--set",
    "trainer.parallel.pipeline=1",
    "--set",
    "data.val=null",
]
COMPARED = ["reward_mean", "loss", "grad_norm", "kl", "logprob_diff_mean", "entropy"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodeCluster]:
    yield from two_node_cluster(num_cpus=2)


def test_tp2_dp2_two_ranks_per_node_equals_one_node(
    cluster: TwoNodeCluster,
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    cluster.ensure_both()
    rc, out = rlbridge(
        env,
        "train",
        *TP2_DP2,
        "--set",
        f"cluster.address={cluster.address}",
        "--set",
        "cluster.nodes=2",
        "--set",
        "cluster.gpus_per_node=2",
        "--run-dir",
        str(tmp_path / "two"),
    )
    assert rc == 0, f"{out[-6000:]}\n{cluster.diagnose()}"
    # the one-node run after the two-node one: its local Ray must not load the machine while node b is needed
    rc, one_out = rlbridge(
        env, "train", *TP2_DP2, "--set", "cluster.gpus_per_node=4", "--run-dir", str(tmp_path / "one")
    )
    assert rc == 0, one_out[-6000:]
    placed = re.findall(r"placement: node (\d): \S+ \(ray node (\w+)[^)]*\): trainer devices (\d, \d)", out)
    assert [(n, d) for n, _, d in placed] == [("0", "0, 1"), ("1", "2, 3")], out[-6000:]
    ranks = re.findall(r"trainer rank (\d): pid \d+, dp (\d) tp (\d) pp 0, host \S+ \(ray node (\w+)\)", out)
    node_of = {int(r): n for r, _, _, n in ranks}
    assert sorted((int(r), int(dp), int(tp)) for r, dp, tp, _ in ranks) == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert node_of[0] == node_of[1] == placed[0][1] != node_of[2] == node_of[3] == placed[1][1], out[
        -6000:
    ]  # tp within a node
    engines = dict(re.findall(r"(?<!placement: )rollout engine (\d): [^(]*\(ray node (\w+)\)", out))
    assert engines == {str(r): node_of[r] for r in range(4)}, out[-6000:]  # engine i beside rank i
    one, two = train_records(tmp_path / "one"), train_records(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert [r["rollout_sha"] for r in one] == [r["rollout_sha"] for r in two]
    for ra, rb in zip(two, one, strict=True):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key, ra[key], rb[key])
    print(
        "\n".join(
            m[0]
            for m in re.finditer(r"(placement|trainer rank \d|rollout engine \d): .*?(?= rlbridge |$)", out)
        )
    )
