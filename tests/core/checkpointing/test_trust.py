"""The core's safe readers load every DCP checkpoint torch writes and refuse code in one line.

A DCP checkpoint holds pickles in two places: ``.metadata`` and the non-tensor values in its
data files. Both are shown to run code through torch's defaults (the planted pickle creates a
marker file), and never through :mod:`mindspeed.checkpointing.trust`.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mindspeed.checkpointing.trust import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UntrustedFileError,
    load_torch_file,
    read_dcp_metadata,
    weights_only_loads,
)
from mindspeed.config import ConfigError


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _load(state: dict, path: Path, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path), no_dist=True, **kwargs)


def test_safe_readers_load_what_dcp_writes(tmp_path: Path) -> None:
    linear = torch.nn.Linear(4, 3).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(linear.parameters(), lr=1e-3, betas=(0.9, 0.95))
    linear(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    state = {
        "model": linear.state_dict(),
        "optim": optimizer.state_dict(),
        "extra": {"name": "x", "flags": [True, None], "pair": (1, 2.5), "steps": torch.arange(5)},
    }
    _save(state, tmp_path)
    ours, torchs = read_dcp_metadata(tmp_path), dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data
    optim = optimizer.state_dict()
    template = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optim": {
            "state": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in optim["state"].items()},
            "param_groups": [{k: None for k in group} for group in optim["param_groups"]],
        },
        "extra": {"name": None, "flags": None, "pair": None, "steps": torch.zeros(5, dtype=torch.long)},
    }
    _load(template, tmp_path, storage_reader=SafeFileSystemReader(str(tmp_path)), planner=SafeLoadPlanner())
    for key, value in state["model"].items():
        assert torch.equal(template["model"][key], value)
    assert template["extra"]["name"] == "x" and template["extra"]["pair"] == (1, 2.5)
    assert template["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(template["optim"]["state"][0]["exp_avg"], optim["state"][0]["exp_avg"])


def test_code_in_a_dcp_checkpoint_runs_through_torch_and_never_here(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    # .metadata: torch's reader runs it; ours names the file and the class.
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UntrustedFileError, match=r"meta/\.metadata holds a pickled posix\.system") as raised:
        read_dcp_metadata(tmp_path / "meta")
    assert "\n" not in str(raised.value) and not marker.exists()
    with pytest.raises(UntrustedFileError):
        SafeFileSystemReader(str(tmp_path / "meta")).read_metadata()
    assert not marker.exists()

    # A non-tensor value: DCP's default planner loads it with weights_only=False.
    _save({"value": _Payload(marker)}, tmp_path / "bytes")
    with pytest.raises(CheckpointException, match="posix.system"):
        _load({"value": None}, tmp_path / "bytes", planner=SafeLoadPlanner())
    assert not marker.exists()
    with weights_only_loads(), pytest.raises(CheckpointException, match="posix.system"):
        _load({"value": None}, tmp_path / "bytes")
    assert not marker.exists()
    _load({"value": None}, tmp_path / "bytes")  # torch's default, unguarded: the code runs
    assert marker.exists()


def test_torch_files_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "MARKER"
    torch.save({"rng": _Payload(marker)}, tmp_path / "state.pt")
    with pytest.raises(UntrustedFileError, match=r"state\.pt was refused .*it holds a pickled posix\.system"):
        load_torch_file(tmp_path / "state.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "state.pt").read_bytes()[:40])
    with pytest.raises(ConfigError, match=r"cut\.pt is unreadable"):
        load_torch_file(tmp_path / "cut.pt")
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD would make torch.load's default unsafe: cleared inside, restored after.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "state.pt", weights_only=False)
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1" and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    assert not marker.exists()
