"""The metrics writer on a full disk: one warning, then the run goes on without writing metrics.

It writes ``metrics.jsonl`` alone: TensorBoard events are the ``tensorboard`` tracker's (its own failures are
the tracking's: tests/core/metrics)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from mindspeed.metrics.log import METRICS_FILE, TENSORBOARD_DIR, MetricsLog, read_metrics


class _Full:
    def __init__(self) -> None:
        self.closed = False

    def write(self, *args: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    flush = write

    def close(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_metrics_warn_once_and_stop(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = MetricsLog(tmp_path, 0, enabled=True)
    log.write({"kind": "train", "step": 1, "loss": 1.0})
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE]  # no TensorBoard events of its own
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    log._file.close()
    log._file = _Full()
    with caplog.at_level(logging.WARNING):
        for step in range(2, 40):
            log.write({"kind": "train", "step": step, "loss": 1.0})
        log.close()
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1]  # what was written stays
