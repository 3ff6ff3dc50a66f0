"""Tensors given as views (Blocks) and their bytes at file offsets: views that do not fit are
refused, and write_blocks / pwrite_all write exactly the bytes of the materialised tensor."""

from __future__ import annotations

import pytest
import torch

from mindspeed.checkpointing import block_io
from mindspeed.checkpointing.blocks import Blocks


def test_views_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot be stacked"):
        Blocks([[torch.zeros(2, 3)], [torch.zeros(2, 4)]])
    with pytest.raises(ValueError, match="rows"):
        Blocks.of(torch.zeros(4, 2)).rows(3, 5)


@pytest.mark.parametrize("min_run", [4, 10**6])
def test_write_blocks_writes_the_tensor_bytes(tmp_path, monkeypatch, min_run: int) -> None:
    # Rows written from where they lie (min_run 4) or gathered (10**6) through a tiny gather
    # buffer, with tiny pwritev calls, so that batching and chunking are exercised.
    monkeypatch.setattr(block_io, "MIN_RUN_BYTES", min_run)
    monkeypatch.setattr(block_io, "SCRATCH_BYTES", 40)
    monkeypatch.setattr(block_io, "_IOV_MAX", 3)
    monkeypatch.setattr(block_io, "_CALL_BYTES", 64)
    monkeypatch.setattr(block_io, "_scratch", None)
    a, b, c = (torch.randn(*size).to(torch.bfloat16) for size in ((6, 10), (6, 4), (3, 6)))
    # Contiguous views, strided views, views side by side, in any order.
    blocks = Blocks([[a[:2, :6]], [a[2:4, 3:9]], [c], [a[4:, :2], b[4:]], [c[1:]], [b[:5, :1], a[:5, 5:10]]])
    for data in (blocks, a[:, 1:5], torch.tensor(3.0), torch.arange(40)):
        path = tmp_path / "out.bin"
        path.write_bytes(b"\xff" * 5)
        with path.open("r+b") as handle:
            expected = data.tensor() if isinstance(data, Blocks) else data
            written = block_io.write_blocks(handle.fileno(), 5, data)
        raw = expected.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert written == len(raw) and path.read_bytes() == b"\xff" * 5 + raw


def test_short_writes_are_resumed(tmp_path, monkeypatch) -> None:
    real = block_io.os.pwritev

    def short_pwritev(fd, buffers, offset):  # the kernel may write less than asked
        data = b"".join(bytes(b) for b in buffers)[:7]
        return real(fd, [data], offset)

    monkeypatch.setattr(block_io.os, "pwritev", short_pwritev)
    monkeypatch.setattr(block_io, "_CALL_BYTES", 10)
    buffers = [memoryview(bytes(range(i, i + size))) for i, size in ((0, 3), (10, 25), (50, 0), (60, 9))]
    path = tmp_path / "out.bin"
    path.write_bytes(b"")
    with path.open("r+b") as handle:
        assert block_io.pwrite_all(handle.fileno(), buffers, 2) == 37
    assert path.read_bytes() == b"\0\0" + b"".join(bytes(b) for b in buffers)
