"""Streamed rank files load with torch.load; the lazy reader reads torch.save files without running code."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from mindspeed_llm.checkpoint.torch_files import LazyTensor, LazyTorchFile, StreamingTorchWriter


def test_streamed_file_equals_torch_save(tmp_path) -> None:
    tensors = {
        "w": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "view": torch.arange(20)[5:9],
        "col": torch.randn(4, 6)[:, 1:3],
        "scalar": torch.tensor(2.5),
    }
    writer = StreamingTorchWriter(tmp_path / "s.pt")
    refs = {name: writer.add(t) for name, t in tensors.items()}
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16)
    writer.close({"args": args, "checkpoint_version": 3.0, "model": {**refs, "linear._extra_state": None}})
    for loaded in (
        torch.load(tmp_path / "s.pt", weights_only=False),
        torch.load(tmp_path / "s.pt", mmap=True, weights_only=False),
    ):
        assert loaded["args"] == args and loaded["checkpoint_version"] == 3.0
        assert loaded["model"]["linear._extra_state"] is None
        for name, tensor in tensors.items():
            got = loaded["model"][name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_lazy_reader_reads_torch_save_without_code(tmp_path) -> None:
    state = {
        "args": argparse.Namespace(hidden_size=8, seed_array=np.arange(3)),
        "model": {"p": torch.nn.Parameter(torch.randn(2, 3)), "v": torch.arange(10.0)[2:6]},
        "rng_state": [{"np_rng_state": np.random.get_state()}],
    }
    torch.save(state, tmp_path / "t.pt")
    lazy = LazyTorchFile(tmp_path / "t.pt")
    assert lazy.obj["args"].hidden_size == 8
    # numpy is outside the allow-list: an inert placeholder, nothing constructed from the file.
    assert type(lazy.obj["args"].seed_array).__module__.startswith("inert:")
    p, v = lazy.obj["model"]["p"], lazy.obj["model"]["v"]
    assert isinstance(p, LazyTensor) and p.shape == (2, 3)
    assert torch.equal(p.load(), state["model"]["p"].data) and torch.equal(v.load(), state["model"]["v"])


def test_truncated_file_is_reported(tmp_path) -> None:
    torch.save({"w": torch.randn(100)}, tmp_path / "t.pt")
    data = (tmp_path / "t.pt").read_bytes()
    (tmp_path / "t.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is it truncated"):
        LazyTorchFile(tmp_path / "t.pt")
