"""megatron-core's dist_checkpointing reads .metadata with plain pickle; inside trusted_dist_loads it cannot run code."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from mindspeed.checkpointing.trust import UntrustedFileError
from mindspeed.megatron.trusted_load import check_dist_checkpoint, trusted_dist_loads

#: megatron's marker of a dist checkpoint (as dist_checkpointing.save writes it).
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_megatron_reads_metadata_through_the_safe_reader(tmp_path: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import torch as strategies

    marker = tmp_path / "MARKER"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (tmp_path / "metadata.json").write_text(json.dumps(METADATA_JSON))
    original = strategies._get_filesystem_reader
    with pytest.raises(UntrustedFileError, match=r"\.metadata holds a pickled posix\.system"):
        check_dist_checkpoint(tmp_path)
    with trusted_dist_loads(), pytest.raises(BaseException, match="posix.system"):
        dist_checkpointing.load_tensors_metadata(str(tmp_path))
    assert strategies._get_filesystem_reader is original and not marker.exists()
    with pytest.raises(AttributeError):  # megatron's own reader: the pickle runs (and returns an int)
        dist_checkpointing.load_tensors_metadata(str(tmp_path))
    assert marker.exists()
