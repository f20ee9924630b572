"""Ray: connect, reserve the plan's bundles, start workers, and turn worker failures into clear errors.

Placement is computed by plan.py; here it is only realized. Waiting for resources prints what is
missing every few seconds and fails after `cluster.placement_timeout_s` with the numbers; a worker that
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

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlbridge.cluster import gc_pauses, logs
from rlbridge.errors import RlbridgeError
from rlbridge.plan import Plan
from rlbridge.recipe.schema import ClusterCfg

Log = Callable[[str], None]
CPU_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
"""glibc malloc in CPU workers: every allocation from one heap that is never handed back. By default each tensor
over 32 MiB (logits, their gradients, merged weights) is a fresh mmap whose pages fault in one by one as they
are first written, and freed memory is returned; on a virtual machine each such fault is expensive. With these:
no fault after the first step, and a faster update (docs/defaults.md#cpu-allocator). A variable
already set in the driver's environment wins."""
HEARTBEAT_S = 30.0
"""While workers start: a line per worker still starting, this often."""
NODE_SETTLE_S = 20.0
"""After a worker on a cluster of several nodes died: how long to wait for the GCS to say whether its node died
too (its health check takes seconds), so that the error can say which."""


def connect(cfg: ClusterCfg, plan: Plan, log: Log) -> None:
    """ray.init: an existing cluster at cfg.address, else a local one sized for the plan. Dashboard off.
    Workers' output stays in their log files (log_to_driver=False)."""
    if ray.is_initialized():
        return
    start = time.monotonic()
    env_vars = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("VLLM_", "OMP_", "RLBRIDGE_", "HF_", "TRANSFORMERS_", "MALLOC_"))
    }
    if cfg.device == "cpu":
        env_vars.update({k: v for k, v in CPU_MALLOC.items() if k not in env_vars})
    env_vars.setdefault(
        "VLLM_LOGGING_LEVEL", "INFO"
    )  # into the rollout's log file: its load/compile/graph times
    env_vars.setdefault("TQDM_DISABLE", "1")  # no progress bar per weight reload (libraries that honour it)
    env = {"env_vars": env_vars}
    if cfg.address:
        log(f"connecting to the Ray cluster at {cfg.address}")
        _check_reachable(cfg.address)
        try:
            ray.init(address=cfg.address, include_dashboard=False, runtime_env=env, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RlbridgeError(
                f"cannot join the Ray cluster at cluster.address {cfg.address}: {_tail(str(e), 3)}"
            ) from None
    else:
        needed_cpu = sum(b.get("CPU", 0) for node in plan.bundles_per_node for b in node) + sum(
            b.get("CPU", 0) for b in plan.rollout_bundles
        )
        gpus = None
        if cfg.device == "cpu":
            gpus = 0
        ray.init(
            num_cpus=max(int(needed_cpu), os.cpu_count() or 1),
            num_gpus=gpus,
            include_dashboard=False,
            runtime_env=env,
            log_to_driver=False,
            configure_logging=False,
        )
    log(f"ray {'connected' if cfg.address else 'started'} ({time.monotonic() - start:.1f} s)")


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A TCP connection to the head's GCS port, so that an address with nothing behind it fails in seconds with
    what to do (ray.init would retry for a minute and end in a traceback)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RlbridgeError(
            f"cluster.address {address!r} is not HOST:PORT (the head's `ray start --head --port PORT`)"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RlbridgeError(
            f"no Ray cluster at cluster.address {address}: {e.strerror or e}. Start one with "
            f"`ray start --head --port {port}` on {host} (and `ray start --address={address}` on the other "
            "nodes), or fix cluster.address (null starts a local one)"
        ) from None


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
                problems.append(f"{node.label()}: no answer ({_tail(str(e), 1)})")
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


class InputLost(RlbridgeError):
    """A task's input, a reference another worker was to produce, was lost with that worker. The caller knows
    which worker that was: asked with Worker.wait(ref), it raises the error that names it (and its node)."""


class Worker:
    """One Ray actor with error translation: calls return results or raise RlbridgeError naming the worker
    and its log file."""

    def __init__(
        self,
        name: str,
        handle: Any,
        log_file: Path | None = None,
        echo: logs.WarningEcho | None = None,
        node: NodeInfo | None = None,
    ) -> None:
        self.name = name
        self.node = node
        """Where it runs, on a cluster of several nodes: named when it dies."""
        self.handle = handle
        self.log_file = log_file
        self.echo = echo
        """Prints the rlbridge warnings this worker wrote into its log file, after each answer."""
        self.explain: Callable[[str], str | None] | None = None
        """Reads a failure's text in the recipe's terms (run/gpu_faults.py: out of GPU memory -> the key to
        change); its sentence leads the error. Set by the session, which knows the recipe."""
        if echo is not None and log_file is not None:
            echo.watch(log_file)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.handle, method).remote(*args, **kwargs)

    def send_started(self) -> Any:
        """A call that answers (a `Started`) once the worker's constructor has finished (`wait_started`)."""
        return self.submit("rlbridge_started")

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self.wait(self.submit(method, *args, **kwargs), timeout=timeout)

    def wait(self, ref: Any, timeout: float | None = None) -> Any:
        try:
            answer = ray.get(ref, timeout=timeout)
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else None
            if isinstance(cause, RlbridgeError):
                raise type(cause)(f"{self.name}: {cause}") from None
            if isinstance(cause, RayActorError):  # an input it was handed died with the worker producing it
                raise InputLost(
                    f"{self.name} worker could not get its input: the worker producing it is gone ({cause!r})"
                ) from None
            hint = self._hint(str(e))
            raise RlbridgeError(
                f"{self.name} worker failed: {hint or repr(cause)}{self._where()}{self._trace(str(e), hint)}"
            ) from None
        except RayActorError as e:
            if e.actor_init_failed:  # its constructor raised: Ray's message holds the traceback
                hint = self._hint(str(e))
                raise RlbridgeError(
                    f"{self.name} worker failed while starting{self._where()}:"
                    + (f"\n{hint}" if hint else "")
                    + self._trace(str(e), hint)
                ) from None
            raise RlbridgeError(
                f"{self.name} worker died{self._on_node()}: {_tail(str(e), 6)}{self._last_lines()}"
            ) from None
        except OutOfMemoryError as e:  # Ray's memory monitor killed it (its call's process) to save the node
            raise RlbridgeError(
                f"{self.name} worker was killed by Ray's memory monitor: the node ran low on host memory "
                f"({_tail(str(e).split(chr(10) + 'OOM kill reason')[0], 2)}). Free memory on the node, or lower "
                f"what the workers hold (rollout.kv_cache_gib on CPU, fewer rollout engines){self._last_lines()}"
            ) from None
        except GetTimeoutError:
            raise RlbridgeError(
                f"{self.name} worker did not answer within {timeout} s{self._where()}"
            ) from None
        if self.echo is not None and self.log_file is not None:
            self.echo.check(self.log_file, self.name)
        return answer

    def _hint(self, text: str) -> str:
        """The recipe-level reading of a failure (self.explain), to lead the error; "" when none."""
        return (self.explain(text) or "") if self.explain is not None else ""

    def _trace(self, text: str, hint: str) -> str:
        """Below the error, the traceback's last lines; after a reading (`hint`), only the exception's own line and
        where the whole traceback went (beside the worker's log), since the reading says what to change."""
        if not hint:
            return f"\n{_tail(text)}"
        line = f"\n{_tail(text, 1)}"
        if self.log_file is None:
            return line
        saved = self.log_file.with_suffix(".error.txt")
        try:
            saved.write_text(text)
        except OSError:
            return line
        return f"{line}\n(the whole traceback: {saved})"

    def _on_node(self) -> str:
        if self.node is None:
            return ""
        gone = not node_alive(self.node.id, settle_s=NODE_SETTLE_S)
        return f" on node {self.node.label()}" + (
            ", which is no longer alive (its host or raylet stopped)" if gone else ""
        )

    def _where(self) -> str:
        return f" (its log: {self.log_file})" if self.log_file else ""

    def _last_lines(self, num_lines: int = 10) -> str:
        lines = logs.tail(self.log_file, num_lines) if self.log_file else []
        if not lines:
            return self._where()
        return f"\nthe last lines of its log ({self.log_file}):\n" + "\n".join(f"  {line}" for line in lines)

    def kill(self) -> None:
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 (already gone)
            pass


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def start_worker(
    cls: type,
    name: str,
    pg: PlacementGroup,
    bundle: int,
    *,
    num_cpus: float,
    num_gpus: float,
    log_file: Path,
    echo: logs.WarningEcho | None = None,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    node: NodeInfo | None = None,
) -> Worker:
    """An actor of `cls` whose output goes to `log_file` (its rlbridge warnings: echoed by `echo`);
    `Worker.send_started()` answers once its constructor has finished (see `_logged`)."""
    actor: Any = ray.remote(_logged(cls)).options(
        name=None,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_restarts=0,
        max_concurrency=1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle
        ),
    )
    return Worker(
        name, actor.remote(*args, rlbridge_log=str(log_file), **(kwargs or {})), log_file, echo, node
    )


@dataclass(frozen=True)
class Started:
    """A worker's answer to `Worker.send_started`."""

    seconds: float
    """Its constructor's seconds."""
    phases: dict[str, float]
    """The start-up phases vLLM logged meanwhile (logs.vllm_phases)."""
    gpus: list[str]
    """The devices Ray gave it (CUDA_VISIBLE_DEVICES)."""
    pid: int = 0
    """Its process id."""
    node: str = ""
    """The Ray node it runs on (its id, read inside the worker)."""


@functools.cache
def _logged(cls: Any) -> type:
    """`cls` (same name, so the process is still `ray::<cls>`) whose constructor first sends the process's
    output to the log file given as `rlbridge_log`, and which answers `rlbridge_started()`: the seconds its
    constructor took and the start-up phases vLLM logged meanwhile (read in the worker: its log file may be
    on another node)."""

    def __init__(self: Any, *args: Any, rlbridge_log: str, **kwargs: Any) -> None:
        start = time.monotonic()
        self._rlbridge_log = (Path(rlbridge_log), logs.redirect_output(Path(rlbridge_log)))
        logs.worker_logging()
        gc_pauses.watch()
        cls.__init__(self, *args, **kwargs)
        gc_pauses.freeze_startup_heap()  # what the constructor built lives for the run: out of every collection
        self._rlbridge_startup_s = time.monotonic() - start

    def rlbridge_started(self: Any) -> Started:
        return Started(
            seconds=self._rlbridge_startup_s,
            phases=logs.vllm_phases(logs.read_from(*self._rlbridge_log)),
            gpus=[str(i) for i in ray.get_gpu_ids()],
            pid=os.getpid(),
            node=node_id(),
        )

    return type(
        cls.__name__,
        (cls,),
        {
            "__init__": __init__,
            "rlbridge_started": rlbridge_started,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )


def wait_started(
    starting: list[tuple[Worker, Any]],
    *,
    timeout_s: float,
    log: Log,
    on_ready: Callable[[Worker, Any], None],
    heartbeat_s: float = HEARTBEAT_S,
) -> list[Any]:
    """Wait for each worker's start-up call (`rlbridge_started`, or a call that needs the started worker),
    calling on_ready(worker, answer) as each answers. Every heartbeat_s a line per worker still starting, with the
    last line of its log; past timeout_s an error naming the worker, what its log shows and the key to raise.
    A worker that fails or dies raises its error (Worker.wait: its log's last lines)."""
    start = time.monotonic()
    pending = {ref: i for i, (_, ref) in enumerate(starting)}
    results: list[Any] = [None] * len(starting)
    beat = start + heartbeat_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0, fetch_local=False)
        for ref in ready:
            i = pending.pop(ref)
            results[i] = starting[i][0].wait(ref)
            on_ready(starting[i][0], results[i])
        waited = time.monotonic() - start
        late = [starting[i][0] for i in sorted(pending.values())]
        if late and waited > timeout_s:
            raise RlbridgeError(startup_timeout_message(late, waited))
        if late and time.monotonic() >= beat:
            beat += heartbeat_s
            for w in late:
                line = logs.last_line(w.log_file) if w.log_file else None
                log(
                    f"{w.name}: still starting ({waited:.0f} s); "
                    + (f"its log: {line}" if line else "nothing in its log yet")
                )
    return results


def startup_timeout_message(late: list[Worker], waited: float) -> str:
    """Which workers did not start, what each one's log shows (its last line, and the phase that suggests)."""
    parts = []
    for w in late:
        phase = logs.stage(logs.tail(w.log_file, 5)) if w.log_file else None
        last = logs.last_line(w.log_file, 300) if w.log_file else None
        shows = (
            f"its log {w.log_file} ends with: {last}"
            if last
            else f"its log {w.log_file} is empty: has its Ray worker process started?"
        )
        parts.append(f"{w.name} ({phase + '; ' if phase else ''}{shows})")
    return (
        f"gave up after {waited:.0f} s waiting for the workers to start: "
        + "; ".join(parts)
        + ". A cold start on GPUs (downloads, torch.compile, CUDA graphs) can take many minutes: if the log shows "
        "progress, raise cluster.startup_timeout_s"
    )


def node_ip() -> str:
    """This process's node address as Ray sees it (a worker's, inside an actor)."""
    return str(ray.util.get_node_ip_address())


def node_id() -> str:
    """This process's Ray node id (a worker's, inside an actor)."""
    return str(ray.get_runtime_context().get_node_id())


def share(value: Any) -> Any:
    """`value` put into Ray's object store once, for several workers' calls (plain scalars pass as they are)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else ray.put(value)


def wait_ready(refs: list[Any], *, num_returns: int, timeout: float, fetch_local: bool = True) -> list[Any]:
    """Those of `refs` that finished (at most `num_returns`, waiting up to `timeout` seconds)."""
    ready, _ = ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
    return list(ready)


def shutdown(pg: PlacementGroup | None = None) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
    if ray.is_initialized():
        ray.shutdown()


def answered(refs: list[Any]) -> list[int]:
    """Waits until at least one of these calls has answered; the positions of those that have."""
    ready, _ = ray.wait(refs, num_returns=1, timeout=None, fetch_local=False)
    done = set(ready)
    return [i for i, ref in enumerate(refs) if ref in done]
