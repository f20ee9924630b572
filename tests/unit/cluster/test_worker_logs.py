"""Library output goes to log files (rlbridge/cluster/logs.py) and is read back: a worker's stdout/stderr
redirected at the descriptor level (Python, C-level and child-process output), the tail of a file with
progress bars, vLLM's start-up phases in its CUDA and CPU wordings, the driver's library logging and warnings,
the reward workers' output, the start-up heartbeat and timeout, the stall warning. No Ray cluster, no vLLM:
`ray.wait` / `ray.get` are replaced where the start-up wait is tested."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from rlbridge.cluster import logs
from rlbridge.data.reward_pool import RewardPool
from rlbridge.errors import RlbridgeError
from rlbridge.metrics.log import Timer
from rlbridge.recipe.schema import RewardCfg
from rlbridge.run.directory import log_file
from rlbridge.run.stalls import StallWatch

ROOT = Path(__file__).resolve().parents[3]

CPU_LOG = """\
INFO 12-01 14:43:40 [cpu_model_runner.py:68] Starting to load model /models/smollm2...
Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]\r\
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:03<00:00,  3.66s/it]
INFO 12-01 14:43:44 [default_loader.py:502] Loading weights took 3.71 seconds
INFO 12-01 14:43:52 [core.py:403] init engine (profile, create kv cache, warmup model) took 1.37 s
"""
CUDA_LOG = """\
(EngineCore_DP0 pid=212) INFO 10-06 12:00:01 [default_loader.py:267] Loading weights took 2.10 seconds
(EngineCore_DP0 pid=212) INFO 10-06 12:00:02 [gpu_model_runner.py:2653] Model loading took 0.2389 GiB and 3.104 seconds
(EngineCore_DP0 pid=212) INFO 10-06 12:00:30 [monitor.py:34] torch.compile takes 33.02 s in total
(EngineCore_DP0 pid=212) INFO 10-06 12:00:40 [gpu_model_runner.py:3480] Graph capturing finished in 12 secs, took 0.31 GiB
(EngineCore_DP0 pid=212) INFO 10-06 12:00:41 [core.py:210] init engine (profile, create kv cache, warmup model) took 47.50 seconds
"""


def test_redirect_output_catches_python_c_level_and_child_output(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "rollout.log"
    path.parent.mkdir()
    path.write_text("an earlier run\n")
    code = (
        "import os, subprocess, sys\n"
        "from pathlib import Path\n"
        "from rlbridge.cluster.logs import redirect_output\n"
        "print('before', flush=True)\n"
        f"offset = redirect_output(Path({str(path)!r}))\n"
        "print('python stdout'); print('python stderr', file=sys.stderr)\n"
        "os.write(1, b'C-level fd 1\\n'); os.write(2, b'C-level fd 2\\n')\n"
        "subprocess.run(['echo', 'child process'])\n"
        "print('offset', offset)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "before\n" and res.stderr == ""  # nothing after the redirect reached the terminal
    lines = path.read_text().splitlines()
    assert lines[0] == "an earlier run"  # appended, not truncated
    assert set(lines[1:]) == {
        "python stdout",
        "python stderr",
        "C-level fd 1",
        "C-level fd 2",
        "child process",
        f"offset {len('an earlier run') + 1}",
    }  # where this process's lines start


def test_tail_reads_progress_bars_as_their_latest_state(tmp_path: Path) -> None:
    path = tmp_path / "rollout.log"
    assert logs.tail(path) == [] and logs.last_line(path) is None  # not there (yet)
    path.write_text(CPU_LOG[: CPU_LOG.index("INFO 12-01 14:43:44")])
    assert (
        logs.last_line(path)
        == "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:03<00:00,  3.66s/it]"
    )
    assert logs.tail(path, 2)[0].startswith("Loading safetensors checkpoint shards:   0%")
    path.write_text("x" * 500 + "\n\n")
    assert logs.last_line(path, width=20) == "x" * 17 + "..."
    path.write_text(CUDA_LOG)  # vLLM's process / time / source prefix is left out
    assert (
        logs.last_line(path) == "INFO init engine (profile, create kv cache, warmup model) took 47.50 seconds"
    )


def test_vllm_phases_in_the_cpu_and_cuda_wordings() -> None:
    assert logs.vllm_phases(CPU_LOG) == {"load": 3.71}  # eager on CPU: no compile, no CUDA graphs
    cuda = logs.vllm_phases(CUDA_LOG)
    assert cuda == {
        "load": 3.104,
        "compile": 33.02,
        "CUDA graphs": 12.0,
    }  # "Model loading" over "Loading weights"
    assert logs.describe_phases(cuda) == "load 3.1 s, compile 33 s, CUDA graphs 12 s"
    newer = (
        "Model loading took 0.24 GiB memory and 1.5 seconds\ntorch.compile took 20.00 s in total\n"
        "Model loading took 0.24 GiB memory and 1.9 seconds\n"
    )  # vLLM 0.32's wording; two TP workers
    assert logs.vllm_phases(newer) == {"load": 1.9, "compile": 20.0}
    assert logs.vllm_phases(
        "init engine (profile, create kv cache, warmup model) took 9.1 s (compilation: 4.20 s)"
    ) == {"compile": 4.2}
    assert logs.vllm_phases("nothing here") == {} and logs.describe_phases({}) == ""
    ours = (
        "2026-12-01 15:02:10,001 INFO rlbridge.rollout.vllm: vLLM imported in 12.3 s\n"  # VllmRollout's line
    )
    assert logs.describe_phases(logs.vllm_phases(ours + CPU_LOG)) == "import 12 s, load 3.7 s"


@pytest.mark.parametrize(
    ("line", "stage"),
    [
        ("Loading safetensors checkpoint shards:  50% Completed | 1/2", "loading the weights"),
        ("INFO [monitor.py:34] Starting torch.compile", "compiling (torch.compile)"),
        ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  40%|", "capturing CUDA graphs"),
        ("INFO [gpu_worker.py:298] Available KV cache memory: 12.15 GiB", "allocating the KV cache"),
        ("something else entirely", None),
    ],
)
def test_stage_of_a_log_line(line: str, stage: str | None) -> None:
    assert logs.stage(["Starting to load model x", line]) == (stage or "loading the weights")
    assert logs.stage([line]) == stage


def test_driver_log_takes_library_logging_and_warnings(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    lib = logging.getLogger("some_library")  # configured as transformers and Ray configure theirs
    own = logging.StreamHandler(sys.stderr)
    lib.addHandler(own)
    lib.propagate = False
    path = log_file(tmp_path, "driver")
    shown: list[str] = []
    try:
        with logs.DriverLog(path, show=shown.append) as driver:
            lib.warning("library chatter")
            logging.getLogger("rlbridge.data.datasets").warning(
                "data.train: 3 rows skipped"
            )  # ours: shown too
            logging.getLogger("other.module").info("root-propagated info")
            warnings.warn("a deprecation", FutureWarning, stacklevel=1)
            late = logging.getLogger("late_library")
            late.addHandler(logging.StreamHandler(sys.stderr))
            late.propagate = False
            driver.apply()  # a library configured after the start (e.g. by ray.init)
            late.warning("late chatter")
        assert own in lib.handlers and len(lib.handlers) == 1  # put back
        text = path.read_text()
        for expected in (
            "library chatter",
            "root-propagated info",
            "FutureWarning: a deprecation",
            "late chatter",
            "data.train: 3 rows skipped",
        ):
            assert expected in text
        assert shown == ["data.train: 3 rows skipped"]
        err = capfd.readouterr().err
        assert "chatter" not in err and "deprecation" not in err
    finally:
        lib.removeHandler(own)
        logging.getLogger("late_library").handlers.clear()


def test_a_workers_own_warnings_reach_the_driver_once(tmp_path: Path) -> None:
    """A worker (here a subprocess) writes rlbridge's warnings as marked lines into its log file, library
    warnings as they are; the driver's WarningEcho prints each of ours once, whichever file it came from."""
    files = [log_file(tmp_path, f"trainer-rank{i}") for i in range(2)]
    files[0].parent.mkdir()
    files[0].write_text(f"{logs.OWN_WARNING}from an earlier run\n")
    shown: list[tuple[str, str]] = []
    echo = logs.WarningEcho(lambda name, msg: shown.append((name, msg)))
    for path in files:
        echo.watch(path)
    code = (
        "import logging, sys, warnings\n"
        "from pathlib import Path\n"
        "from rlbridge.cluster import logs\n"
        "logs.redirect_output(Path(sys.argv[1]))\n"
        "logs.worker_logging()\n"
        "logging.getLogger('rlbridge.rollout.vllm').info('weights v1 loaded')\n"
        "logging.getLogger('rlbridge.rollout.vllm').warning('rollout.max_lora_rank=12 is not a vLLM LoRA size')\n"
        "from rlbridge import faults\n"  # as if a module of ours called warnings.warn
        "warnings.warn_explicit('recompute.method is ignored', UserWarning, faults.__file__, 1)\n"
        "warnings.warn('a library deprecation', FutureWarning, stacklevel=1)\n"
    )
    for path in files:  # two ranks, the same warnings
        subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, check=True, timeout=60)
        echo.check(path, path.stem)
    assert shown == [
        ("trainer-rank0", "rollout.max_lora_rank=12 is not a vLLM LoRA size"),
        ("trainer-rank0", "UserWarning: recompute.method is ignored"),
    ]
    text = files[1].read_text()
    assert (
        "INFO rlbridge.rollout.vllm: weights v1 loaded" in text
        and "FutureWarning: a library deprecation" in text
    )
    with files[1].open("a") as f:
        f.write(f"{logs.OWN_WARNING}a new one, half writ")
    echo.check(files[1], "trainer-rank1")
    assert len(shown) == 2  # a line still being written is read once it is whole
    with files[1].open("a") as f:
        f.write("ten\n")
    echo.check(files[1], "trainer-rank1")
    assert shown[-1] == ("trainer-rank1", "a new one, half written")


def test_reward_workers_write_to_their_log_file(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = log_file(tmp_path, "reward")
    with RewardPool(RewardCfg(fn="tests.fixtures.reward_fns:chatty", workers=1), log_file=path) as pool:
        assert pool.score(["p"], ["7"], [{"answer": "7"}]).scores == [1.0]
    assert "chatty scored '7'" in path.read_text() and "chatty on fd 2" in path.read_text()
    out = capfd.readouterr()
    assert "chatty" not in out.out + out.err


# ----------------------------------------------------------------------------------- start-up wait
class _Handle:
    def __getattr__(self, name: str) -> Any:
        return None


def _fake_ray(
    monkeypatch: pytest.MonkeyPatch, ready_after: dict[str, float], answers: dict[str, Any]
) -> None:
    """ray.wait / ray.get over string refs: ref r is ready `ready_after[r]` seconds after the first wait."""
    import ray

    start: list[float] = []

    def wait(
        refs: list[str], num_returns: int = 1, timeout: float = 0.0, fetch_local: bool = True
    ) -> tuple[list[str], list[str]]:
        start.append(start[0] if start else time.monotonic())
        time.sleep(0.01)
        done = [r for r in refs if time.monotonic() - start[0] >= ready_after[r]][:num_returns]
        return done, [r for r in refs if r not in done]

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: answers[ref])


def test_startup_heartbeat_then_timeout_names_the_worker_its_phase_and_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlbridge.cluster import ray_cluster as rc

    rollout_log, trainer_log = log_file(tmp_path, "rollout"), log_file(tmp_path, "trainer")
    rollout_log.parent.mkdir()
    rollout_log.write_text("INFO loading\nINFO [monitor.py:34] Starting torch.compile\n")
    trainer = rc.Worker("trainer", _Handle(), trainer_log)
    rollout = rc.Worker("rollout", _Handle(), rollout_log)
    _fake_ray(monkeypatch, {"t": 0.0, "r": 1e9}, {"t": {"seconds": 1.0, "phases": {}}})
    lines: list[str] = []
    ready: list[str] = []
    with pytest.raises(RlbridgeError) as info:
        rc.wait_started(
            [(trainer, "t"), (rollout, "r")],
            timeout_s=0.35,
            log=lines.append,
            on_ready=lambda w, answer: ready.append(w.name),
            heartbeat_s=0.1,
        )
    assert ready == ["trainer"]
    assert lines and all(line.startswith("rollout: still starting (") for line in lines)
    assert lines[0].endswith("its log: INFO [monitor.py:34] Starting torch.compile")
    message = str(info.value)
    for part in (
        "rollout (compiling (torch.compile)",
        str(rollout_log),
        "Starting torch.compile",
        "cluster.startup_timeout_s",
    ):
        assert part in message, message
    assert "trainer" not in message  # it had started


def test_startup_timeout_of_a_worker_whose_process_never_started(tmp_path: Path) -> None:
    from rlbridge.cluster import ray_cluster as rc

    message = rc.startup_timeout_message(
        [rc.Worker("trainer", _Handle(), log_file(tmp_path, "trainer"))], 901.2
    )
    assert message.startswith("gave up after 901 s waiting for the workers to start: trainer (its log ")
    assert "trainer.log is empty: has its Ray worker process started?)" in message
    assert message.endswith("raise cluster.startup_timeout_s")


def test_startup_wait_returns_the_answers_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbridge.cluster import ray_cluster as rc

    workers = [rc.Worker(name, _Handle(), log_file(tmp_path, name)) for name in ("trainer", "rollout")]
    _fake_ray(monkeypatch, {"t": 0.05, "r": 0.0}, {"t": "T", "r": "R"})
    order: list[str] = []
    got = rc.wait_started(
        list(zip(workers, ["t", "r"], strict=True)),
        timeout_s=10,
        log=print,
        on_ready=lambda w, answer: order.append(w.name),
    )
    assert got == ["T", "R"] and order == ["rollout", "trainer"]


def test_a_dead_worker_error_shows_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    from ray.exceptions import ActorDiedError

    from rlbridge.cluster import ray_cluster as rc

    path = log_file(tmp_path, "rollout")
    path.parent.mkdir()
    path.write_text("".join(f"line {i}\n" for i in range(30)) + "Capturing CUDA graphs:  40%\r")

    def get(ref: Any, timeout: float | None = None) -> Any:
        raise ActorDiedError()

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(RlbridgeError) as info:
        rc.Worker("rollout", _Handle(), path).wait("ref")
    message = str(info.value)
    assert message.startswith("rollout worker died: ")
    assert f"the last lines of its log ({path}):\n  line 21\n" in message and message.endswith(
        "Capturing CUDA graphs:  40%"
    )


# ------------------------------------------------------------------------------------ stall warning
def test_stall_watch_warns_about_a_phase_far_slower_than_before() -> None:
    lines: list[str] = []
    watch = StallWatch(lines.append, hint=" (logs: RUN/logs)", factor=5.0, floor_s=0.4)
    timer = Timer(watch)
    with timer("generate"):
        time.sleep(0.3)  # the first run is not watched (nothing to compare with)
    assert lines == []
    for _ in range(3):
        with timer("generate"):
            time.sleep(0.01)
    assert lines == []
    usual, limit = watch.limit("generate")  # type: ignore[misc]
    assert limit == pytest.approx(max(5 * usual, 0.4))
    with timer("generate"):
        time.sleep(limit * 2.5)  # two stretches past the limit: two lines
    time.sleep(0.1)
    assert len(lines) == 2, lines
    assert lines[0].startswith("generate is stalled: running for 0 s,") and lines[0].endswith(
        "(logs: RUN/logs)"
    )
    with timer("update"):
        pass  # another phase has its own history
    assert watch.limit("update") is not None and len(timer.seconds) == 2
    time.sleep(0.05)
    assert not [
        t for t in threading.enumerate() if t.name.startswith("rlbridge-stall-")
    ]  # each ends with its phase


def test_worker_log_lines_print_as_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    """A heartbeat or warning quotes a worker's log line: its brackets are not rich markup (a torch line
    starts "[W1201 ... utils.cpp:68]", which rich would swallow as a style; "[/x]" would raise)."""
    from rlbridge.metrics.log import log_plain

    line = "rollout: its log: [W1201 15:02:26.689 utils.cpp:68] Warning [/x]"  # short: no wrap
    log_plain(line)
    assert capsys.readouterr().err == f"rlbridge {line}\n"
