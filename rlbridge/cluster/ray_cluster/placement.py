"""Where the run goes: the cluster's alive nodes checked against cluster.nodes x cluster.gpus_per_node, the
plan's bundles reserved (saying what is missing while it waits), each bundle's node read back so that ranks
are laid out node by node (`Placement`), and, before any worker starts, proof from every node that it sees the
run directory (`check_shared_run_dir`). Placement is computed by the plan (rlbridge/plan/); here it is only
realized."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rlbridge.cluster.logs import tail_text
from rlbridge.cluster.ray_cluster.connect import Log
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import ClusterCfg


@dataclass(frozen=True)
class NodeInfo:
    """An alive node of the Ray cluster."""

    id: str
    ip: str
    head: bool
    resources: dict[str, float]

    def label(self) -> str:
        return f"{self.ip} (ray node {self.id[:8]}{', head' if self.head else ''})"


def alive_nodes() -> list[NodeInfo]:
    """The cluster's alive nodes, the head first."""
    found = [
        NodeInfo(
            str(n["NodeID"]),
            str(n["NodeManagerAddress"]),
            "node:__internal_head__" in n["Resources"],
            {k: float(v) for k, v in n["Resources"].items()},
        )
        for n in ray.nodes()
        if n["Alive"]
    ]
    return sorted(found, key=lambda n: not n.head)


def check_nodes(cfg: ClusterCfg) -> list[NodeInfo]:
    """Fails at once, listing every node, when the cluster has fewer alive nodes than cluster.nodes, or fewer
    nodes with cluster.gpus_per_node devices each. (A cluster that autoscales would have to be grown first.)"""
    unit = "GPU" if cfg.device == "cuda" else "CPU"
    nodes = alive_nodes()
    listing = "; ".join(f"{n.label()}: {unit} {n.resources.get(unit, 0):g}" for n in nodes)
    if len(nodes) < cfg.nodes:
        raise RlbridgeError(
            f"cluster.nodes is {cfg.nodes} but the Ray cluster at {cfg.address} has {len(nodes)} alive node"
            f"{'s' if len(nodes) != 1 else ''} ({listing}): start the missing ones with `ray start --address={cfg.address}` "
            f"on each host, or set cluster.nodes: {len(nodes)}"
        )
    by_size = sorted(nodes, key=lambda n: -n.resources.get(unit, 0))[: cfg.nodes]
    short = [n for n in by_size if n.resources.get(unit, 0) < cfg.gpus_per_node]
    if short:
        lacks = "; ".join(
            f"{n.label()} has {n.resources.get(unit, 0):g} {unit}, {cfg.gpus_per_node - n.resources.get(unit, 0):g} "
            "short"
            for n in short
        )
        flag = "--num-gpus" if unit == "GPU" else "--num-cpus"
        raise RlbridgeError(
            f"the plan needs {cfg.nodes} nodes with {cfg.gpus_per_node} {unit} each (cluster.nodes x cluster.gpus_per_node) "
            f"but the Ray cluster at {cfg.address} has too few: {lacks} (all nodes: {listing}). Start the nodes with "
            f"`ray start ... {flag} {cfg.gpus_per_node}`, or lower cluster.gpus_per_node / cluster.nodes"
        )
    return nodes


def _missing(bundles: list[dict[str, float]]) -> str:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0) + v
    have = ray.available_resources()
    total = ray.cluster_resources()
    parts = [
        f"{k}: need {v:g}, available {have.get(k, 0):g} of {total.get(k, 0):g}"
        for k, v in sorted(need.items())
    ]
    return "; ".join(parts)


def reserve(
    bundles: list[dict[str, float]], *, timeout_s: float, log: Log, fail_fast: bool = True
) -> PlacementGroup:
    """Create a placement group and wait for it, saying what it waits for.

    fail_fast: a plan larger than the whole cluster fails at once (a local cluster cannot grow; an
    autoscaling one, given by cluster.address, may, so there we wait up to the timeout)."""
    total = ray.cluster_resources()
    for key in {k for b in bundles for k in b}:
        if fail_fast and sum(b.get(key, 0) for b in bundles) > total.get(key, 0):
            raise RlbridgeError(
                f"the cluster can never satisfy the plan: {_missing(bundles)} "
                "(check cluster.nodes / cluster.gpus_per_node, or cluster.address)"
            )
    pg = placement_group(bundles, strategy="PACK")
    start = time.monotonic()
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=5.0)
        if ready:
            return pg
        waited = time.monotonic() - start
        if waited > timeout_s:
            msg = _missing(bundles)
            remove_placement_group(pg)
            raise RlbridgeError(
                f"gave up after {waited:.0f} s waiting for Ray resources: {msg} "
                "(cluster.placement_timeout_s sets the wait)"
            )
        log(f"waiting for Ray resources ({waited:.0f} s): {_missing(bundles)}")


@dataclass(frozen=True)
class Placement:
    """Where a reserved placement group's bundles landed: `slots[i]` is the bundle of trainer device i (rank i),
    chosen so that devices fill the nodes in order (node 0: the node of bundle 0, which also holds a colocated
    rollout); `nodes[j]` is plan node j's Ray node."""

    slots: list[int]
    nodes: list[NodeInfo]
    node_of_slot: list[int]
    """Plan node index of each trainer device (same order as slots)."""
    rollout_nodes: list[NodeInfo]
    """The nodes of separate rollout engines' bundles (after the trainer's, one per engine), in bundle order; empty
    when colocated."""

    def describe(self) -> list[str]:
        lines = [
            f"node {j}: {n.label()}: trainer devices {', '.join(str(i) for i, k in enumerate(self.node_of_slot) if k == j)}"
            for j, n in enumerate(self.nodes)
        ]
        return lines + [f"rollout engine {i}: {n.label()}" for i, n in enumerate(self.rollout_nodes)]


def placement(pg: PlacementGroup, num_trainer: int) -> Placement:
    """Read back which node each bundle landed on; the first `num_trainer` (the trainer's) ordered node by node."""
    table = ray.util.placement_group_table(pg)
    node_ids = [str(table["bundles_to_node_id"][i]) for i in range(len(table["bundles_to_node_id"]))]
    slots, order, node_of_slot = by_node(node_ids[:num_trainer])
    info = {n.id: n for n in alive_nodes()}

    def node(nid: str) -> NodeInfo:
        return info.get(nid, NodeInfo(nid, "?", False, {}))

    return Placement(
        slots, [node(nid) for nid in order], node_of_slot, [node(nid) for nid in node_ids[num_trainer:]]
    )


SHARED_DIR_TIMEOUT_S = 60.0
"""How long the shared run directory check waits for each node's answer."""


def _read_token(path: str, token: str, reply: str) -> dict[str, str]:
    """On one node: what it reads at `path` (the driver wrote `token` there), and a reply file written back."""
    out = {"host": socket.gethostname(), "problem": ""}
    try:
        seen = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        out["problem"] = f"cannot read it ({e.strerror or e})"
        return out
    if seen != token:
        out["problem"] = "it holds another token (another directory at the same path?)"
        return out
    try:
        Path(reply).write_text(token, encoding="utf-8")
    except OSError as e:
        out["problem"] = f"cannot write next to it ({e.strerror or e})"
    return out


def check_shared_run_dir(run_dir: Path, nodes: list[NodeInfo], log: Log) -> None:
    """Before any worker starts on a cluster of several nodes: each node proves that it sees the run directory.
    The driver writes a random token file into it; one Ray task per node (pinned to the node, no CPU) reads the
    file at the same path and writes a reply beside it, which the driver reads back. A node that cannot read
    the token, reads another, or whose reply the driver does not see (a node-local directory, a mount missing
    or mounted elsewhere on that node) stops the run naming the node and the fix: its checkpoints (written on
    trainer rank 0's node) and its workers' logs would otherwise land where a resume never finds them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    run_dir = Path(run_dir).resolve()
    token = os.urandom(16).hex()
    path = run_dir / f".node-check-{token}"
    path.write_text(token, encoding="utf-8")
    task = ray.remote(num_cpus=0, max_retries=0)(_read_token)
    unique = list({n.id: n for n in nodes}.values())
    replies = [path.with_name(f"{path.name}.{n.id[:12]}") for n in unique]
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.id, soft=False)).remote(
            str(path), token, str(reply)
        )
        for n, reply in zip(unique, replies, strict=True)
    ]
    problems = []
    try:
        for node, ref, reply in zip(unique, refs, replies, strict=True):
            try:
                seen = ray.get(ref, timeout=SHARED_DIR_TIMEOUT_S)
            except (GetTimeoutError, RayTaskError, RayActorError) as e:
                problems.append(f"{node.label()}: no answer ({tail_text(str(e), 1)})")
                continue
            if not seen["problem"] and not (reply.is_file() and reply.read_text(encoding="utf-8") == token):
                seen["problem"] = "its reply file does not reach the driver (a node-local directory?)"
            if seen["problem"]:
                problems.append(f"{node.label()}, host {seen['host']}: {seen['problem']}")
    finally:
        for file in (path, *replies):
            file.unlink(missing_ok=True)
    if problems:
        raise RlbridgeError(
            f"the run directory {run_dir} is not shared with every node: the driver wrote {path.name} there; "
            + "; ".join(problems)
            + ". Every node must see the run directory at the same path (checkpoints are written on trainer rank "
            "0's node, logs by every worker, and a resume reads them back): put it on a filesystem all nodes mount "
            "at the same path (NFS, Lustre, ...) and pass it with `rlbridge train ... --run-dir DIR`"
        )
    log(f"run directory {run_dir}: seen by all {len(unique)} nodes")


def by_node(node_ids: list[str]) -> tuple[list[int], list[str], list[int]]:
    """Bundles (bundle i on node node_ids[i]) ordered node by node: (the bundle of each device, the nodes in
    order of first use (bundle 0's first), the node index of each device). Ranks that follow this order keep
    megatron's fastest-varying groups (tensor parallel) on one node."""
    order = list(dict.fromkeys(node_ids))
    slots = sorted(range(len(node_ids)), key=lambda i: (order.index(node_ids[i]), i))
    return slots, order, [order.index(node_ids[i]) for i in slots]


def node_alive(node_id: str, *, settle_s: float = 0.0) -> bool:
    """Whether the node is alive; with settle_s, asks again for up to that long while it still is (the GCS
    notices a lost node a few seconds after the workers on it are gone)."""
    deadline = time.monotonic() + settle_s
    while True:
        alive = any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.5)


def node_ip() -> str:
    """This process's node address as Ray sees it (a worker's, inside an actor)."""
    return str(ray.util.get_node_ip_address())


def node_id() -> str:
    """This process's Ray node id (a worker's, inside an actor)."""
    return str(ray.get_runtime_context().get_node_id())
