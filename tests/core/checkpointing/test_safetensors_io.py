"""Streamed safetensors shards load with the safetensors library; broken checkpoints fail clearly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mindspeed.checkpointing.safetensors_io import HFCheckpoint, SafetensorsShardWriter


def test_writer_output_loads_with_safetensors(tmp_path) -> None:
    tensors = {
        "a": torch.randn(10, 3),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(5),
        "d": torch.randn(2, 2),
    }
    writer = SafetensorsShardWriter(
        tmp_path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], max_shard_bytes=130
    )
    for name in ["d", "b", "a", "c"]:  # any order
        writer.write(name, tensors[name])
    writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # a (120 B) alone, then b + c + d (70 B)
    loaded = {}
    for file in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / file))
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    with pytest.raises(ValueError, match="not a pending tensor"):
        writer.write("a", tensors["a"])


def test_reader_matches_save_file(tmp_path) -> None:
    tensors = {"x": torch.randn(4, 5), "y": torch.randn(3).to(torch.float16)}
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = HFCheckpoint(tmp_path)
    assert checkpoint.shapes() == {"x": (4, 5), "y": (3,)}
    for name, tensor in tensors.items():
        assert torch.equal(checkpoint.read(name), tensor)


def test_broken_checkpoints_fail_naming_the_file(tmp_path) -> None:
    save_file({"x": torch.randn(64)}, tmp_path / "model-1.safetensors")
    index = {"weight_map": {"x": "model-1.safetensors", "y": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"points at model-2\.safetensors, which is not in"):
        HFCheckpoint(tmp_path)
    index["weight_map"] = {"x": "model-1.safetensors", "y": "model-1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"places y in model-1\.safetensors, but that shard does not hold it"):
        HFCheckpoint(tmp_path)
    index["weight_map"] = {"x": "model-1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    data = (tmp_path / "model-1.safetensors").read_bytes()
    (tmp_path / "model-1.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match=r"model-1\.safetensors is truncated"):
        HFCheckpoint(tmp_path)
