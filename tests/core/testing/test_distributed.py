"""The spawned-ranks harness: results come back, failures and hangs fail fast."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mindspeed.testing.distributed import DistributedTestError, run_distributed


def _collectives(rank: int, world_size: int, scale: float) -> dict:
    value = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(value)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    return {
        "rank": dist.get_rank(),
        "sum": value.item(),
        "gathered": [g.item() for g in gathered],
        "backend": dist.get_backend(),
        "tensor": value,  # a tensor comes back by value, after the rank has exited
        "cwd": os.getcwd(),
        "marker": os.environ.get("MINDSPEED_TEST_CALLER_MARKER"),
    }


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    time.sleep(0.2)


def _hang_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)


@pytest.mark.distributed
def test_results_in_rank_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks see the caller's current directory and environment (they fork from a server started earlier).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINDSPEED_TEST_CALLER_MARKER", "set-after-the-server-started")
    results = run_distributed(_collectives, 2, 0.5)
    expected_sum = sum((r + 1) * 0.5 for r in range(2))
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == expected_sum for r in results)
    assert all(r["gathered"] == [0.0, 1.0] for r in results)
    assert results[0]["backend"] == "gloo"
    assert all(torch.equal(r["tensor"], torch.tensor([expected_sum])) for r in results)
    assert {r["cwd"] for r in results} == {str(tmp_path)}
    assert {r["marker"] for r in results} == {"set-after-the-server-started"}


@pytest.mark.distributed
def test_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(DistributedTestError, match="boom on rank one"):
        run_distributed(_raise_on_rank_one, 2, timeout=60)


@pytest.mark.distributed
def test_hanging_rank_times_out() -> None:
    start = time.monotonic()
    # Rank 0 usually finishes first; on a loaded machine both may still be starting up.
    with pytest.raises(DistributedTestError, match=r"ranks \[(0, )?1\] did not finish within 5 s"):
        run_distributed(_hang_on_rank_one, 2, timeout=5)
    assert time.monotonic() - start < 60  # killed at the deadline, not after rank 1's 600 s
