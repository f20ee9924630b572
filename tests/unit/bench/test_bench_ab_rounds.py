"""bench/ab_rounds.py's summary arithmetic against a hand computation: the ratio of the pooled median step times,
the min-max of the per-round ratios, time to first step and wall time, and which rounds count (both tools
completed); bench/trl_grpo.py's --trl-config parsing; the check of --trl-config leaves the environment the rlbridge
runs inherit as it was; a run that rlbridge's validate-recipe refuses stops the benchmark before its first
round."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from bench.ab_rounds import check_args, headline, is_run_file, summarize_rounds
from bench.trl_grpo import parse_trl_config


def run(tool: str, k: int, steps: list[float], first: float, wall: float) -> dict[str, object]:
    return {
        "tool": tool,
        "round": k,
        "per_step_s": steps,
        "startup_s": first - steps[0],
        "time_to_first_step_s": first,
        "total_wall_s": wall,
    }


RUNS = [
    run("rlbridge", 1, [1.0, 2.0, 3.0], first=100.0, wall=120.0),
    run("trl", 1, [3.0, 3.0, 6.0], first=80.0, wall=90.0),
    run("rlbridge", 2, [2.0, 2.0, 4.0], first=50.0, wall=60.0),
    run("trl", 2, [4.0, 5.0, 6.0], first=60.0, wall=100.0),
    run("rlbridge", 3, [0.1, 0.1, 0.1], first=1.0, wall=1.0),  # its TRL run failed: round 3 is left out
    {"tool": "trl", "round": 3, "failed": True, "error": "killed"},
]


def test_summary_matches_a_hand_computation() -> None:
    s = summarize_rounds(RUNS)
    assert s["rounds"] == [1, 2] and s["rounds_each"] == 2 and s["rounds_left_out"] == [3]
    # pooled steps of rounds 1-2: rlbridge 1 2 2 2 3 4 -> median 2.0; trl 3 3 4 5 6 6 -> median 4.5
    assert s["rlbridge"]["step_s_median"] == 2.0 and s["trl"]["step_s_median"] == 4.5
    assert s["rlbridge"]["steps_timed"] == 6
    assert s["rlbridge"]["step_s_round_medians"] == [2.0, 2.0]
    assert s["trl"]["step_s_round_medians"] == [3.0, 5.0]
    ratio = s["trl_over_rlbridge"]
    assert ratio["step_s"]["ratio_of_medians"] == pytest.approx(4.5 / 2.0)
    assert ratio["step_s"]["rounds"] == pytest.approx([1.5, 2.5])
    assert (ratio["step_s"]["round_min"], ratio["step_s"]["round_max"]) == pytest.approx((1.5, 2.5))
    # time to first step: rlbridge 100, 50 -> median 75; trl 80, 60 -> 70; per round 0.8 and 1.2
    assert s["rlbridge"]["time_to_first_step_s"] == {"median": 75.0, "min": 50.0, "max": 100.0}
    first = ratio["time_to_first_step_s"]
    assert first["ratio_of_medians"] == pytest.approx(70.0 / 75.0)
    assert (first["round_min"], first["round_max"]) == pytest.approx((0.8, 1.2))
    # wall: rlbridge 120, 60 -> 90; trl 90, 100 -> 95; per round 0.75 and 5/3
    wall = ratio["wall_s"]
    assert wall["ratio_of_medians"] == pytest.approx(95.0 / 90.0)
    assert (wall["round_min"], wall["round_max"]) == pytest.approx((0.75, 100.0 / 60.0))
    line = headline("sync vs sync", s)
    assert line.startswith("sync vs sync: trl / rlbridge step time 2.25x (rounds 1.50-2.50x")
    assert "2 rounds each" in line


def test_no_complete_round_says_so() -> None:
    s = summarize_rounds(RUNS[4:])
    assert s["rounds_each"] == 0 and "trl_over_rlbridge" not in s
    assert "no round" in headline("sync vs sync", s)


def test_round_files_and_trl_config_values() -> None:
    assert is_run_file(Path("round2-trl.json"))
    assert not is_run_file(Path("round2-trl.record.json"))
    assert parse_trl_config(
        ["gradient_checkpointing=true", "vllm_gpu_memory_utilization=0.3", "optim=adamw"]
    ) == {
        "gradient_checkpointing": True,
        "vllm_gpu_memory_utilization": 0.3,
        "optim": "adamw",
    }
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_trl_config(["gradient_checkpointing"])


def test_a_run_past_its_deadline_is_killed_with_its_children(tmp_path: Path) -> None:
    from bench.trl_grpo import group_alive, measure

    m = measure(["bash", "-c", "sleep 30 & sleep 30"], tmp_path / "log", timeout_s=0.5)
    assert m["timed_out"] and m["rc"] != 0
    assert m["end"] - m["start"] < 5
    pgid = m["mem"].root.pid  # the child led its own process group
    assert group_alive(pgid) == []


def test_segment_attention_matches_an_explicit_softmax() -> None:
    """bench/trl_async.py's CPU stand-in for FlashAttention's varlen call (AsyncGRPO's tree attention): segments
    with more keys than queries (a tree row's path), causal from the end, 4 query heads on 2 K/V heads; against
    softmax(q.k * scale) written out in float64."""
    import math

    import torch

    from bench.trl_async import segment_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu_q, cu_k = torch.tensor([0, 3, 7]), torch.tensor([0, 5, 9])
    got = segment_attention(q, k, v, cu_q, cu_k, scale=0.3, causal=True)
    want = torch.zeros(7, 4, 8, dtype=torch.float64)
    for (q0, q1), (k0, k1) in (((0, 3), (0, 5)), ((3, 7), (5, 9))):
        lq, lk = q1 - q0, k1 - k0
        for j in range(lq):
            for h in range(4):
                keys = range(lk - lq + j + 1)  # query j sees keys up to j + lk - lq
                w = [math.exp(0.3 * float(q[q0 + j, h].double() @ k[k0 + b, h // 2].double())) for b in keys]
                want[q0 + j, h] = sum(
                    wb * v[k0 + b, h // 2].double() for wb, b in zip(w, keys, strict=True)
                ) / sum(w)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_checking_trl_config_leaves_the_environment_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # trl 1.16's import sets VLLM_LOGGING_LEVEL=ERROR in os.environ (trl._compat._patch_vllm_logging); a stand-in
    # package does the same where trl is not installed (it is not a project dependency)
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text(
        "import dataclasses, os\n"
        "os.environ['VLLM_LOGGING_LEVEL'] = os.getenv('VLLM_LOGGING_LEVEL', 'ERROR')\n"
        "@dataclasses.dataclass\n"
        "class GRPOConfig:\n"
        "    gradient_checkpointing: bool = False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    real = sys.modules.pop("trl", None)
    try:
        check_args(argparse.Namespace(trl_config=["gradient_checkpointing=true"], trl_async=False))
        assert str(sys.modules["trl"].__file__).startswith(str(tmp_path))  # the stand-in was imported here
        assert "VLLM_LOGGING_LEVEL" not in os.environ
        with pytest.raises(SystemExit, match="not GRPOConfig fields"):
            check_args(argparse.Namespace(trl_config=["no_such_key=1"], trl_async=False))
    finally:
        sys.modules.pop("trl", None)
        if real is not None:
            sys.modules["trl"] = real


def test_a_run_rlbridge_would_refuse_stops_before_the_first_round(monkeypatch: pytest.MonkeyPatch) -> None:
    # the real CLI (validate-recipe) on the CPU quickstart: an accepted run passes, a refused one stops the benchmark
    # with the CLI's key and fix, as a plan refusal on an 80 GB card did after two TRL rounds had spent the budget
    from bench import trl_grpo

    root = Path(__file__).resolve().parents[3]
    monkeypatch.setattr(trl_grpo, "RECIPE", root / "recipes" / "quickstart.yaml")
    trl_grpo.validate_rlbridge(2, [])
    with pytest.raises(SystemExit, match=r"(?s)rlbridge would refuse.*rollout\.max_response_tokens.*fix:"):
        trl_grpo.validate_rlbridge(2, ["rollout.max_response_tokens=0"])
