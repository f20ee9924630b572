"""The workers: one Ray actor each, started into a bundle with its output in its own log file
(cluster/logs.py; Ray forwards nothing to the driver's terminal). `Worker` turns failures into RlbridgeErrors
that name the worker, its log file and its node; waiting for the workers to start prints a heartbeat with the
last line of each one's log and fails after `cluster.startup_timeout_s`; a dead worker's last lines are shown.
Also the object-store helpers the groups use to hand one value to several workers and to wait on calls."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlbridge.cluster import gc_pauses, logs
from rlbridge.cluster.logs import tail_text
from rlbridge.cluster.ray_cluster.connect import Log
from rlbridge.cluster.ray_cluster.placement import NodeInfo, node_alive, node_id
from rlbridge.errors import RlbridgeError

HEARTBEAT_S = 30.0
"""While workers start: a line per worker still starting, this often."""
NODE_SETTLE_S = 20.0
"""After a worker on a cluster of several nodes died: how long to wait for the GCS to say whether its node died
too (its health check takes seconds), so that the error can say which."""


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
                f"{self.name} worker died{self._on_node()}: {tail_text(str(e), 6)}{self._last_lines()}"
            ) from None
        except OutOfMemoryError as e:  # Ray's memory monitor killed it (its call's process) to save the node
            raise RlbridgeError(
                f"{self.name} worker was killed by Ray's memory monitor: the node ran low on host memory "
                f"({tail_text(str(e).split(chr(10) + 'OOM kill reason')[0], 2)}). Free memory on the node, or lower "
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
            return f"\n{tail_text(text)}"
        line = f"\n{tail_text(text, 1)}"
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
        # the constructor's heap lives for the run: no full collections while it grows, then frozen
        with gc_pauses.paused():
            cls.__init__(self, *args, **kwargs)
            gc_pauses.freeze_startup_heap()  # then out of every collection (frozen before they resume)
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


def share(value: Any) -> Any:
    """`value` put into Ray's object store once, for several workers' calls (plain scalars pass as they are)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else ray.put(value)


def wait_ready(refs: list[Any], *, num_returns: int, timeout: float, fetch_local: bool = True) -> list[Any]:
    """Those of `refs` that finished (at most `num_returns`, waiting up to `timeout` seconds)."""
    ready, _ = ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
    return list(ready)


def answered(refs: list[Any]) -> list[int]:
    """Waits until at least one of these calls has answered; the positions of those that have."""
    ready, _ = ray.wait(refs, num_returns=1, timeout=None, fetch_local=False)
    done = set(ready)
    return [i for i, ref in enumerate(refs) if ref in done]
