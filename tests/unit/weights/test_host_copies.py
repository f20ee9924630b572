"""weights.hf_files.host_copies: the export's host copies joined into few transfers, and the files they make."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlbridge.weights import WeightExport, WeightSync
from rlbridge.weights.hf_files import ADAPTER_FILE, host_copies, save_hf


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.lora_A.weight": torch.randn(4, 6, generator=g),
        "a.lora_B.weight": torch.randn(6, 4, generator=g),
        "big": torch.randn(64, 64, generator=g),  # 16 KiB: alone with chunk_bytes below
        "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "strided": torch.randn(5, 4, generator=g).t(),  # not contiguous
        "ids": torch.arange(7),
    }


@pytest.mark.parametrize("chunk_bytes", [1 << 26, 200, 1])
def test_host_copies_equal_and_never_alias_the_live_tensors(chunk_bytes: int) -> None:
    live = _tensors()
    out = host_copies(live, chunk_bytes=chunk_bytes)
    assert list(out) == list(live)  # same names in the same order
    for name, t in live.items():
        c = out[name]
        assert c.device.type == "cpu" and c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t), name
    before = {n: t.clone() for n, t in live.items()}
    for t in live.values():  # the live tensors move on (as the next train step moves them)
        t.add_(1) if t.is_floating_point() else t.mul_(3)
    for name, c in out.items():
        assert torch.equal(c, before[name]), f"{name} changed with the live tensor"


def test_joined_copies_share_one_buffer_and_save_as_separate_tensors(tmp_path: Path) -> None:
    live = {
        f"m{i}.lora_{ab}.weight": torch.full((2, 3), float(i) + (ab == "B")) for i in range(5) for ab in "AB"
    }
    out = host_copies(live)
    ptrs = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(ptrs) == 1  # one float32 buffer: one transfer from a device
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["m"]}
    path = save_hf(tmp_path / "adapter", WeightExport("adapter", out, config)) / ADAPTER_FILE
    loaded = load_file(str(path))
    assert list(loaded) == sorted(live) and all(torch.equal(loaded[n], live[n]) for n in live)


def test_write_safetensors_reads_back_as_save_file_writes(tmp_path: Path) -> None:
    """write_safetensors against safetensors' own reader and writer: every dtype it names, views of one buffer,
    a tensor written twice under two names, empty, scalar and strided tensors; the tensors and metadata read
    back equal (bitwise), as do those of save_file's file of the same tensors (the header's layout may differ)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from rlbridge.weights.hf_files import SAFETENSORS_DTYPES, write_safetensors

    tensors = _tensors()
    tensors["alias"] = tensors["a.lora_A.weight"]  # shares storage: save_file refuses this
    joined = host_copies({"x": torch.ones(3), "y": torch.full((2, 2), 3.0)})  # views of one buffer
    tensors.update({f"joined.{k}": v for k, v in joined.items()})
    for dtype in SAFETENSORS_DTYPES:
        tensors[f"dtype.{dtype}"] = torch.arange(5).to(dtype)
    path = tmp_path / "w.safetensors"
    size = write_safetensors(tensors, path, metadata={"format": "pt"})
    assert size == path.stat().st_size
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  # safe_open is not a mapping
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(
            got[name].view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
        ), name
    plain = {k: v.clone().contiguous() for k, v in tensors.items()}
    save_file(plain, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    ref = load_file(str(tmp_path / "ref.safetensors"))
    assert all(torch.equal(ref[k].view(-1).view(torch.uint8), got[k].view(-1).view(torch.uint8)) for k in ref)
    with pytest.raises(ValueError, match="not the CPU"):
        write_safetensors({"m": torch.zeros(1, device="meta")}, tmp_path / "x.safetensors")


def test_an_export_of_host_copies_pickles_to_its_own_size_not_a_buffer_per_view() -> None:
    """Ray pickles a WeightExport between trainer and rollout workers (several engines, other nodes). torch
    pickles a view with its whole storage: the ~420 views host_copies makes of one buffer went out ~420 times."""
    import pickle

    from ray import cloudpickle

    g = torch.Generator().manual_seed(1)
    adapter = {f"l{i}.lora_{ab}.weight": torch.randn(16, 64, generator=g) for i in range(60) for ab in "AB"}
    adapter["strided"] = torch.randn(8, 16, generator=g).t()
    size = sum(t.numel() * t.element_size() for t in adapter.values())
    export = WeightExport(WeightSync.ADAPTER, host_copies(adapter), {"r": 16})
    views = sum(t.untyped_storage().nbytes() for t in export.tensors.values())
    assert views > 50 * size  # what torch would pickle without the compaction
    for dumps in (pickle.dumps, cloudpickle.dumps):
        blob = dumps(export, protocol=5)
        assert len(blob) < 1.05 * size + 64 * 1024, (dumps, len(blob), size)
        back = pickle.loads(blob)
        assert back.kind == WeightSync.ADAPTER and back.adapter_config == {"r": 16}
        assert list(back.tensors) == list(adapter)
        for name, t in adapter.items():
            assert torch.equal(back.tensors[name], t), name
    first = export.tensors["l0.lora_A.weight"]  # the sender's export is left as it was (views)
    assert first.untyped_storage().nbytes() > first.numel() * first.element_size()
