"""RewardPool: score completions with user reward functions that may raise, hang, spam or exit.

User functions run in a small pool of worker processes, each fed one sample at a time over a socket, so a
sample that runs past `reward.timeout_s` is killed with its whole process group and a fresh worker takes
its place while the others carry on (`concurrent.futures` cannot kill one worker, hence this pool).
Workers are fresh interpreters started with `subprocess` (the trainer holds torch and threads, so no fork)
rather than multiprocessing's spawn, which would re-run the trainer's `__main__` module in every worker.
Each worker runs in its own session (terminal Ctrl-C goes to the trainer, which closes the pool), with
stdin on /dev/null and stdout/stderr appended to `log_file` (a run's logs/reward.log; /dev/null without
one), and dies with the trainer (Linux PR_SET_PDEATHSIG, tied to the thread
that started it: create the pool in a thread that outlives it). Workers live across `score` calls (the loop
scores every step) and import the user functions once, at start.

Builtin rewards (ours, pure string parsing that cannot hang) run in-process: a builtin-only recipe
starts no worker at all. A batched user function (TRL's form, rewards.py) is one task of the batch: it runs in a
worker beside the per-sample tasks, with reward.timeout_s times the batch size to finish; a failure of that call
fails the term on every sample of the batch. Reward models (`reward.terms[].model`) are batched terms too, held by
one worker of their own (on the term's device), which the other tasks never reach: their weights load once, and
their seconds and failures are reported apart (RewardResult.model_seconds, model_errors).

Every failure of a user function (an exception, NaN/inf or a non-number, a timeout, `sys.exit`,
`os._exit`) makes that sample's score None and counts against `reward.error_budget`, kept over the
whole run; past it `score` raises `RewardBudgetExceeded` with the last traceback. Output is not an error
(it goes to the log file). Not thread-safe.
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbridge import faults
from rlbridge.data.rewards import (
    BUILTINS,
    RewardFn,
    batch_kwargs,
    call_batched,
    is_batched,
    resolve_reward_fn,
)
from rlbridge.errors import RlbridgeError

if TYPE_CHECKING:  # workers import this module: keep pydantic out of their start-up
    from rlbridge.recipe.schema import RewardCfg, RewardTerm

Outcome = tuple[float | None, str | None]
"""(value, None) or (None, traceback text) for one reward term on one sample."""
Task = tuple[str, str, dict[str, Any]]
Job = tuple[str, Any]
"""What a worker is sent: ("sample", Task), scored by every per-sample user function, or ("batch", (j, kwargs)),
one call of the j-th batched user function. It answers ("done", (outcomes, seconds))."""
_TRACEBACK_CHARS = 4000
_WORKER_CODE = "import sys; from rlbridge.data.reward_pool import worker_main; worker_main(int(sys.argv[1]))"
_PR_SET_PDEATHSIG = 1


class RewardBudgetExceeded(RlbridgeError):
    """More reward errors over the run than `reward.error_budget` allows."""


@dataclass(frozen=True)
class ModelSpec:
    """A reward model term as a worker builds it (model/reward_model.py)."""

    path: str
    device: str = "cpu"
    batch_size: int = 16


BatchSpec = str | ModelSpec
"""A batched term as the workers get it: a function's `package.module:function`, or a reward model."""


@dataclass
class RewardResult:
    scores: list[float | None]
    """Weighted sum per sample; None where any term failed."""
    num_errors: int
    """Samples with at least one failed term."""
    errors: list[str] = field(default_factory=list)
    """One line per failed sample: index, function, and the last line of its traceback."""
    terms: dict[str, list[float | None]] = field(default_factory=dict)
    """Per-term values (key: the term's fn, suffixed #i when a fn repeats)."""
    last_traceback: str | None = None
    """Full text of the last failure in this call."""
    model_seconds: float = 0.0
    """Seconds the reward model terms took to score this call (their worker's, summed over the terms)."""
    model_errors: int = 0
    """Samples a reward model term failed on (also counted in num_errors)."""


def _call(fn: RewardFn, prompt: str, completion: str, sample: dict[str, Any]) -> Outcome:
    try:
        value = fn(prompt, completion, sample)
        if not isinstance(value, numbers.Real):
            raise TypeError(
                f"reward function returned {type(value).__name__} {str(value)[:100]!r}, not a float"
            )
        if not math.isfinite(value := float(value)):
            raise ValueError(f"reward function returned {value}, not a finite number")
        return value, None
    except (Exception, SystemExit):  # sys.exit in user code is a sample error; Ctrl-C still stops the trainer
        return None, traceback.format_exc()[-_TRACEBACK_CHARS:]


def _call_batch(fn: Any, kwargs: dict[str, Any]) -> list[Outcome]:
    """A batched function's outcomes, one per completion: None is "not scored" (TRL's NaN), not an error."""
    n = len(kwargs["completions"])
    try:
        values = call_batched(fn, kwargs)
    except (Exception, SystemExit):
        return [(None, traceback.format_exc()[-_TRACEBACK_CHARS:])] * n
    out: list[Outcome] = []
    for i, value in enumerate(values):
        if value is None:
            out.append((None, None))
        elif not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            out.append((None, f"ValueError: batched reward {i} is {str(value)[:100]!r}, not a finite number"))
        else:
            out.append((float(value), None))
    return out


def _batch_fn(spec: BatchSpec | None) -> Any:
    """A worker's batched scorer: a reward model (loaded here, once) or a batched function; None for a term that
    another kind of worker scores."""
    if spec is None:
        return None
    if isinstance(spec, ModelSpec):
        from rlbridge.model.reward_model import RewardModel

        return RewardModel(spec.path, batch_size=spec.batch_size, device=spec.device)
    return resolve_reward_fn(spec, True)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def worker_main(fd: int) -> None:
    """Worker process: take sys.path and the specs, import the functions once, then score until told to stop."""
    conn = Connection(fd)
    _die_with_parent()
    try:
        sys.path[:], specs, batch_specs = conn.recv()
        fns = [resolve_reward_fn(spec, False) for spec in specs]
        batch_fns = [_batch_fn(spec) for spec in batch_specs]
    except BaseException:  # noqa: B036
        conn.send(("error", traceback.format_exc()[-_TRACEBACK_CHARS:]))
        return
    conn.send(("ready", None))
    try:
        while (job := conn.recv()) is not None:
            faults.pause("reward")  # tests kill this worker here (rlbridge/faults.py); a no-op otherwise
            kind, payload = job
            start = time.perf_counter()
            if kind == "batch":
                j, kwargs = payload
                outcomes = _call_batch(batch_fns[j], kwargs)
            else:
                outcomes = [_call(fn, *payload) for fn in fns]
            conn.send(("done", (outcomes, time.perf_counter() - start)))
    except EOFError:  # the trainer went away
        return


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: Connection
    deadline: float
    models: bool = False
    """The reward models' worker: it holds them and gets only their tasks."""
    ready: bool = False
    task: int | None = None
    started: float = 0.0


class RewardPool:
    """Scores batches with the recipe's reward terms; a context manager owning the worker processes."""

    _jobs: list[Job] = []
    """The jobs of the `score` call in progress (for their time limits and error sizes)."""

    def __init__(
        self, cfg: RewardCfg, *, startup_timeout_s: float = 120.0, log_file: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.log_file = log_file
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
        self.terms = cfg.resolved_terms()
        self.batched = [
            t.fn is None or (t.batched if t.batched is not None else is_batched(resolve_reward_fn(t.fn)))
            for t in self.terms
        ]
        """Per term: a batched (TRL-style) function, or a reward model."""
        for term, batched in zip(self.terms, self.batched, strict=True):
            if term.fn is not None:
                resolve_reward_fn(term.fn, batched)  # fail here, in the trainer, with the validation message
        self._user_specs = [
            t.name for t, b in zip(self.terms, self.batched, strict=True) if t.name not in BUILTINS and not b
        ]
        self._batch_specs: list[BatchSpec] = [
            ModelSpec(t.model, t.device, t.batch_size) if t.model is not None else str(t.fn)
            for t, b in zip(self.terms, self.batched, strict=True)
            if b
        ]
        self._seconds: dict[int, float] = {}
        """Seconds per task of the `score` call in progress (the worker's own timing; to its death or timeout)."""
        self._model_jobs: list[int] = []
        """The reward models' tasks of that call."""
        self._startup_timeout_s = startup_timeout_s
        self._workers: list[_Worker] = []
        self.total_errors = 0

    @property
    def has_batched(self) -> bool:
        """Some term is a batched (TRL-style) function: `score` wants its `batch` keyword lists."""
        return bool(self._batch_specs)

    def __enter__(self) -> RewardPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ workers
    def _spawn(self, models: bool = False) -> _Worker:
        ours, theirs = socket.socketpair()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        with open(self.log_file or os.devnull, "ab") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env=env,
            )
        theirs.close()  # so the worker's death reads as EOF here
        conn = Connection(ours.detach())
        batch = [s if isinstance(s, ModelSpec) == models else None for s in self._batch_specs]
        conn.send(([p or os.getcwd() for p in sys.path], [] if models else self._user_specs, batch))
        return _Worker(proc, conn, deadline=time.monotonic() + self._startup_timeout_s, models=models)

    def _kill(self, w: _Worker) -> None:
        if w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)  # the worker leads its own process group
            except ProcessLookupError:
                pass
        w.proc.wait(5)
        w.conn.close()
        self._workers.remove(w)

    def start(self) -> None:
        """Start the workers (reward.workers for the user functions, one for the reward models; none for builtins
        only) and wait until they are ready."""
        if not (self._user_specs or self._batch_specs) or self._workers:
            return
        models = any(isinstance(s, ModelSpec) for s in self._batch_specs)
        functions = bool(self._user_specs) or not all(isinstance(s, ModelSpec) for s in self._batch_specs)
        self._workers = [self._spawn() for _ in range(self.cfg.workers if functions else 0)]
        self._workers += [self._spawn(models=True)] if models else []
        while not all(w.ready for w in self._workers):
            self._step(deque(), [], [])

    def close(self) -> None:
        for w in list(self._workers):
            try:
                w.conn.send(None)
            except OSError:
                pass
            try:
                w.proc.wait(2)
            except subprocess.TimeoutExpired:
                pass
            self._kill(w)

    # -------------------------------------------------------------------------------- scheduling
    def _step(self, queue: deque[int], tasks: list[Job], out: list[list[Outcome] | None]) -> None:
        """Hand queued tasks to idle workers, then handle one round of results, deaths and timeouts."""
        self._jobs = tasks
        for w in list(self._workers):
            if w.ready and w.task is None and queue:
                pick = next((q for q in queue if self._for_models(tasks[q]) == w.models), None)
                if pick is None:
                    continue
                queue.remove(pick)
                w.task = pick
                w.started = time.monotonic()
                w.deadline = w.started + self._time_limit(tasks[w.task])
                try:
                    w.conn.send(tasks[w.task])
                except OSError:  # died while idle: the task never ran; retry it elsewhere
                    queue.appendleft(w.task)
                    self._replace(w, None, out)
        active = [w for w in self._workers if not w.ready or w.task is not None]
        timeout = max(0.0, min((w.deadline for w in active), default=0.0) - time.monotonic())
        wait([w.conn for w in active], timeout)
        for w in active:
            self._poll(w, out)

    def _poll(self, w: _Worker, out: list[list[Outcome] | None]) -> None:
        if w.conn.poll():
            try:
                kind, payload = w.conn.recv()
            except (EOFError, OSError):
                kind, payload = "died", None
        elif w.proc.poll() is not None:
            kind, payload = "died", None
        elif time.monotonic() >= w.deadline:
            kind, payload = "timeout", None
        else:
            return
        if not w.ready:
            if kind != "ready":
                self._kill(w)
                why = payload or (
                    f"not ready within {self._startup_timeout_s}s (does importing the reward module hang?)"
                    if kind == "timeout"
                    else f"the worker exited with code {w.proc.returncode}; check that "
                    f"`{sys.executable} -c 'import rlbridge.data.reward_pool'` works"
                )
                raise RlbridgeError(f"reward worker failed to start:\n{why}")
            w.ready = True
        elif kind == "done" and w.task is not None:
            out[w.task], self._seconds[w.task] = payload
            w.task = None
        elif kind == "timeout":
            job = self._jobs[w.task] if w.task is not None else ("sample", None)
            limit = self._time_limit(job)
            self._replace(
                w,
                f"TimeoutError: reward function ran past reward.timeout_s={self.cfg.timeout_s}s"
                if job[0] == "sample"
                else f"TimeoutError: a batched reward call ran past {limit:g}s (reward.timeout_s="
                f"{self.cfg.timeout_s}s per sample of the batch)",
                out,
            )
        else:
            try:
                code: int | str = w.proc.wait(5)
            except subprocess.TimeoutExpired:
                code = "unknown (it closed its socket)"
            self._replace(
                w,
                f"reward worker process exited with code {code} while scoring "
                "(os._exit, a signal or a crash in the reward function)",
                out,
            )

    def _for_models(self, job: Job) -> bool:
        """A reward model's task (for the models' worker only)."""
        kind, payload = job
        return kind == "batch" and isinstance(self._batch_specs[payload[0]], ModelSpec)

    def _time_limit(self, job: Job) -> float:
        """reward.timeout_s per sample: a batched call scores the whole batch."""
        kind, payload = job
        return self.cfg.timeout_s * (len(payload[1]["completions"]) if kind == "batch" else 1)

    def _replace(self, w: _Worker, error: str | None, out: list[list[Outcome] | None]) -> None:
        if error is not None and w.task is not None:
            kind, payload = self._jobs[w.task]
            size = len(payload[1]["completions"]) if kind == "batch" else len(self._user_specs)
            out[w.task] = [(None, error)] * size
            self._seconds[w.task] = time.monotonic() - w.started
        self._kill(w)
        self._workers.append(self._spawn(models=w.models))

    def _run_user(self, tasks: list[Job]) -> list[list[Outcome]]:
        self.start()
        out: list[list[Outcome] | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        while queue or any(w.task is not None for w in self._workers):
            self._step(queue, tasks, out)
        done = [o for o in out if o is not None]
        assert len(done) == len(tasks), "every task ends with a result or an error"
        return done

    # ------------------------------------------------------------------------------------ scoring
    def score(
        self,
        prompts: list[str],
        completions: list[str],
        samples: list[dict[str, Any]],
        *,
        batch: dict[str, Any] | None = None,
    ) -> RewardResult:
        """Weighted reward per sample; raises RewardBudgetExceeded once the run's errors pass the budget.

        batch: the keyword lists of the batched terms (rewards.batch_kwargs; default: built from these prompts,
        completions and samples)."""
        if not len(prompts) == len(completions) == len(samples):
            raise ValueError(
                f"{len(prompts)} prompts, {len(completions)} completions, {len(samples)} samples"
            )
        tasks = list(zip(prompts, completions, samples, strict=True))
        if self._batch_specs and batch is None:
            batch = batch_kwargs(list(prompts), list(completions), list(samples))
        self._seconds = {}
        result = _combine(self.terms, self._evaluate(tasks, batch), len(tasks))
        result.model_seconds = sum(self._seconds.get(i, 0.0) for i in self._model_jobs)
        self.total_errors += result.num_errors
        if self.total_errors > self.cfg.error_budget:
            raise RewardBudgetExceeded(
                f"{self.total_errors} reward errors so far exceed reward.error_budget={self.cfg.error_budget} "
                f"({result.num_errors} of {len(tasks)} samples failed in this step). "
                "Fix the reward function, or raise reward.error_budget / reward.timeout_s. "
                f"Last failure: {result.last_traceback}"
            )
        return result

    def _evaluate(self, tasks: list[Task], batch: dict[str, Any] | None) -> list[list[Outcome]]:
        """Outcomes per term (in recipe order) per sample: builtins in-process, user terms in the workers (the
        per-sample tasks and one task per batched term, all queued together)."""
        if not tasks:
            return [[] for _ in self.terms]
        jobs: list[Job] = [("sample", t) for t in tasks] if self._user_specs else []
        jobs += [("batch", (j, batch)) for j in range(len(self._batch_specs))]
        self._model_jobs = [i for i, job in enumerate(jobs) if self._for_models(job)]
        done = self._run_user(jobs) if jobs else []
        per_sample, batched = (
            done[: len(jobs) - len(self._batch_specs)],
            done[len(jobs) - len(self._batch_specs) :],
        )
        user_columns = iter(zip(*per_sample, strict=True)) if self._user_specs else iter(())
        batch_columns = iter(batched)
        out: list[list[Outcome]] = []
        for t, b in zip(self.terms, self.batched, strict=True):
            if b:
                out.append(list(next(batch_columns)))
            elif t.name in BUILTINS:
                out.append([_call(BUILTINS[t.name], *task) for task in tasks])
            else:
                out.append(list(next(user_columns)))
        return out


def _combine(terms: list[RewardTerm], per_term: list[list[Outcome]], num_samples: int) -> RewardResult:
    fns = [t.name for t in terms]
    names = [fn if fns.count(fn) == 1 else f"{fn}#{j}" for j, fn in enumerate(fns)]
    result = RewardResult(
        scores=[],
        num_errors=0,
        terms={name: [v for v, _ in column] for name, column in zip(names, per_term, strict=True)},
    )
    for i in range(num_samples):
        outcomes = [column[i] for column in per_term]
        failed = [(fn, err) for fn, (_, err) in zip(fns, outcomes, strict=True) if err is not None]
        if failed:
            fn, err = failed[-1]
            result.num_errors += 1
            result.model_errors += any(
                t.model is not None and o[1] is not None for t, o in zip(terms, outcomes, strict=True)
            )
            result.errors.append(f"sample {i}, {fn}: {err.strip().splitlines()[-1][:500]}")
            result.last_traceback = f"{fn} on sample {i}:\n{err}"
            result.scores.append(None)
        else:
            result.scores.append(
                sum(t.weight * v for t, (v, _) in zip(terms, outcomes, strict=True) if v is not None)
            )
    return result
