"""Ray: connect, reserve the plan's bundles, start workers, and turn worker failures into clear errors. The only
place that imports Ray; the rest of the code imports every name from `rlbridge.cluster.ray_cluster`.

    connect.py     join or start the cluster, with the workers' environment; shut it down
    placement.py   alive nodes against the recipe, reserve the bundles, read back where they landed, check
                   that every node sees the run directory
    workers.py     one actor per worker: start it, wait for it (heartbeat, timeout), translate its failures

Placement is computed by the plan (rlbridge/plan/); here it is only realized. Waiting for resources prints what
is missing every few seconds and fails after `cluster.placement_timeout_s` with the numbers; a worker that
dies makes the next call raise with the worker's own error instead of hanging.

On a cluster of several nodes (cluster.address): before reserving, the alive nodes are checked against
cluster.nodes x cluster.gpus_per_node (an error lists every node and what it lacks); after, each bundle's node is
read back so that ranks are laid out node by node (`Placement`), printed, and named in a dead worker's error;
then, before any worker starts, every node of the placement proves that it sees the run directory
(`check_shared_run_dir`).

Each worker writes its output to its own log file (cluster/logs.py; Ray forwards nothing to the driver's
terminal). Waiting for the workers to start prints a heartbeat with the last line of each one's log and
fails after `cluster.startup_timeout_s`; an error names the worker's log, and a dead worker's last lines
are shown.
"""

from rlbridge.cluster.ray_cluster.connect import CPU_MALLOC, Log, connect, shutdown
from rlbridge.cluster.ray_cluster.placement import (
    NodeInfo,
    Placement,
    alive_nodes,
    by_node,
    check_nodes,
    check_shared_run_dir,
    node_alive,
    node_id,
    node_ip,
    placement,
    reserve,
)
from rlbridge.cluster.ray_cluster.workers import (
    InputLost,
    Started,
    Worker,
    answered,
    share,
    start_worker,
    startup_timeout_message,
    wait_ready,
    wait_started,
)

__all__ = [
    "CPU_MALLOC",
    "InputLost",
    "Log",
    "NodeInfo",
    "Placement",
    "Started",
    "Worker",
    "alive_nodes",
    "answered",
    "by_node",
    "check_nodes",
    "check_shared_run_dir",
    "connect",
    "node_alive",
    "node_id",
    "node_ip",
    "placement",
    "reserve",
    "share",
    "shutdown",
    "start_worker",
    "startup_timeout_message",
    "wait_ready",
    "wait_started",
]
