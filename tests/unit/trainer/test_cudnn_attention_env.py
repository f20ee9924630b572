"""RLBRIDGE_CUDNN_ATTENTION: `0` turns torch's cuDNN attention off in a trainer process (a process-wide torch flag,
restored after each test); anything but 0/1/unset is a clear error naming the variable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rlbridge.errors import RlbridgeError
from rlbridge.trainer.role import CUDNN_ATTENTION_ENV, apply_cudnn_attention_env


@pytest.fixture(autouse=True)
def restore() -> Iterator[None]:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_unset_or_1_keeps_torchs_default() -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert apply_cudnn_attention_env({}) is True
    assert apply_cudnn_attention_env({CUDNN_ATTENTION_ENV: "1"}) is True
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_0_turns_cudnn_attention_off() -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert apply_cudnn_attention_env({CUDNN_ATTENTION_ENV: " 0 "}) is False
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_bad_value_names_the_variable() -> None:
    with pytest.raises(RlbridgeError, match=f"{CUDNN_ATTENTION_ENV}='off': expected 0"):
        apply_cudnn_attention_env({CUDNN_ATTENTION_ENV: "off"})
