"""A reward model term on the GPU (`reward.terms[].device: cuda`, issue 46 item 3): SmolLM2-135M-Instruct's real
weights under a sequence-classification head (seeded, saved by the test) scored by the reward pool's models' worker
on CUDA, in right-padded batches, against the same model in float32 on the CPU scoring one unpadded text at a time
(the independent reference). The worker must hold the model on the GPU (the device's used memory grows by at least
the model's float32 weights while the pool is up) and the function workers must not load it.

Tolerance: float32 on both sides; CUDA kernels sum in another order than the CPU's and padding changes the
attention's reduction shapes, so scores agree to ~1e-5 relative, not bit for bit. The bound, 1e-3 absolute on
scores of order 1, leaves room for TF32 if a site turns it on. GPU time: ~20 s (model load, 2 batches).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbridge.data.reward_pool import RewardPool
from rlbridge.model.reward_model import RewardModel
from rlbridge.recipe.schema import RewardCfg
from rlbridge.run.gpu_faults import nvidia_smi
from tests.gpu.common import DRY_RUN, P, figure, model_dir

pytestmark = [pytest.mark.timeout(600 if DRY_RUN else 180)]

PROMPTS = ["What is 2 + 2 ?", "Name a prime number.", "What is 12 times 3 ?", "Say hi.", "What is 7 - 9 ?"]
COMPLETIONS = [" 4", " 7 is prime.", " 12 x 3 = 36 #### 36", " Hi there, how can I help you today?", " -2"]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2-rm")
    torch.manual_seed(0)
    src = model_dir()
    model = AutoModelForSequenceClassification.from_pretrained(str(src), num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = model.config.eos_token_id
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
    return out


def test_reward_model_scores_on_the_gpu_as_on_the_cpu(reward_dir: Path) -> None:
    terms = [
        {"model": str(reward_dir), "weight": 1.0, "device": P.device, "batch_size": 2},
        {"fn": "format", "weight": 0.0},
        {"fn": "tests.fixtures.reward_fns:no_reward_model_here", "weight": 0.0},
    ]
    cfg = RewardCfg.model_validate({"terms": terms, "workers": 1})
    reference = RewardModel(str(reward_dir), batch_size=1, device="cpu")
    want = reference(prompts=PROMPTS, completions=COMPLETIONS)
    rows = [{"question": p, "answer": "4"} for p in PROMPTS]
    before = _used_mib()
    with RewardPool(cfg) as pool:
        res = pool.score(PROMPTS, COMPLETIONS, rows)
        during = _used_mib()
    assert res.num_errors == 0 and res.model_errors == 0, res.errors
    assert res.terms["tests.fixtures.reward_fns:no_reward_model_here"] == [1.0] * len(PROMPTS)
    got = res.terms[f"model:{reward_dir}"]
    diff = max(abs(a - b) for a, b in zip(got, want, strict=True))  # type: ignore[operator]
    weights_mib = sum(p.numel() * 4 for p in reference.model.parameters()) / 2**20
    figure("reward_model_gpu_vs_cpu", max_abs_diff=diff, scores=want, seconds=res.model_seconds,
           device_mib_before=before, device_mib_during=during, weights_mib=weights_mib)  # fmt: skip
    assert diff < 1e-3 and len(set(want)) == len(want)
    if not DRY_RUN:
        assert before is not None and during is not None and during - before >= weights_mib, (before, during)


def _used_mib() -> float | None:
    """GPU 0's used memory (every process), from nvidia-smi; None without it."""
    out = nvidia_smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0")
    return float(out.split()[0]) if out and out.split() else None
