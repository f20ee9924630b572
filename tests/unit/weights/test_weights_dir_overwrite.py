"""weights.directory.overwrite_merged: a same-node merged export written into the previous version's file in place
(the page-allocation cost of a fresh 540 MB file in /dev/shm was 2-4 s per sync on a 2-core VM). The file must
read back as the new version (safetensors' own loader), in the rollout's dtype; any change of names, shapes or
dtypes falls back to a fresh file (returns False, file untouched); read_export_dir copies out of a kept
directory and leaves it in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlbridge.weights import WeightExport
from rlbridge.weights.directory import overwrite_merged, read_export_dir, write_merged


def _export(scale: float, **extra: torch.Tensor) -> WeightExport:
    gen = torch.Generator().manual_seed(int(scale * 10))
    tensors = {
        "model.embed_tokens.weight": torch.randn(11, 4, generator=gen) * scale,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=gen) * scale,
        "model.norm.weight": torch.ones(4) * scale,
        # a non-float tensor keeps its dtype
        "model.layers.0.mlp.bias_mask": torch.tensor([True, False, True]),
        **extra,
    }
    return WeightExport("merged", tensors)


def _base(tmp: Path) -> Path:
    base = tmp / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama", "torch_dtype": "float32"}')
    (base / "tokenizer.json").write_text("{}")
    return base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overwrite_reads_back_as_the_new_version(tmp_path: Path, dtype: torch.dtype) -> None:
    out = tmp_path / "out"
    write_merged(_export(1.0), out, base_dir=_base(tmp_path), dtype=dtype)
    inode = (out / "model.safetensors").stat().st_ino
    new = _export(2.0)
    assert overwrite_merged(new, out, dtype=dtype)
    assert (out / "model.safetensors").stat().st_ino == inode  # the same file, not a replacement
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(new.tensors)
    for name, want in new.tensors.items():
        want = want.to(dtype) if want.is_floating_point() else want
        assert got[name].dtype == want.dtype
        torch.testing.assert_close(got[name], want, rtol=0, atol=0)


def test_a_changed_layout_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert not overwrite_merged(_export(1.0), out, dtype=torch.float32)  # no file yet
    write_merged(_export(1.0), out, base_dir=_base(tmp_path), dtype=torch.float32)
    before = (out / "model.safetensors").read_bytes()
    reshaped = _export(2.0)
    reshaped.tensors["model.norm.weight"] = torch.ones(5)
    for changed in (
        _export(2.0, extra=torch.zeros(2)),  # one more name
        reshaped,  # another shape
    ):
        assert not overwrite_merged(changed, out, dtype=torch.float32)
    assert not overwrite_merged(_export(2.0), out, dtype=torch.bfloat16)  # another dtype
    assert (out / "model.safetensors").read_bytes() == before


def test_read_export_dir_copies_out_of_a_kept_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_merged(_export(1.0), out, base_dir=_base(tmp_path), dtype=torch.float32)
    got = read_export_dir(WeightExport("merged", {}, path=str(out), sender_keeps=True))
    assert out.is_dir()
    assert overwrite_merged(_export(3.0), out, dtype=torch.float32)  # the next version, in place
    torch.testing.assert_close(got.tensors["model.norm.weight"], torch.ones(4))  # still the first version
    read_export_dir(WeightExport("merged", {}, path=str(out)))  # the receiver's own directory: removed
    assert not out.exists()
