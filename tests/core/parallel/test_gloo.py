"""One gloo device for a one-rank run (mindspeed.parallel.gloo, applied by mindspeed.launch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mindspeed.launch import launch
from mindspeed.parallel.gloo import one_gloo_device

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names from /proc")

GROUPS = 8


def _loop_threads() -> int:
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == "gloo_tcp_loop"
        except OSError:  # the thread ended meanwhile
            continue
    return count


def _groups_and_collectives() -> dict:
    # megatron's way: many groups over the same rank, each used for collectives.
    groups = [dist.new_group([0]) for _ in range(GROUPS)]
    x = torch.arange(6, dtype=torch.float32)
    summed = x.clone()
    for group in groups:
        dist.all_reduce(summed, group=group)
    gathered = torch.empty(6)
    dist.all_gather_into_tensor(gathered, x, group=groups[1])
    listed = [torch.empty(6)]
    dist.all_gather(listed, x, group=groups[2])
    sent = x.clone()
    dist.broadcast(sent, 0, group=groups[3])
    dist.barrier(group=groups[4])
    return {
        "loops": _loop_threads(),
        "outputs": [summed, gathered, listed[0], sent],
        "patched": c10d.ProcessGroupGloo.__name__,
    }


def test_one_rank_run_shares_one_device_with_the_same_results() -> None:
    original, before = c10d.ProcessGroupGloo, _loop_threads()
    shared = launch(_groups_and_collectives, nproc_per_node=1)
    assert shared["patched"] == "SharedDeviceGloo"
    assert c10d.ProcessGroupGloo is original  # reverted after the run
    # One loop thread for the default group and the eight others (torch: one per group).
    assert shared["loops"] - before == 1
    x = torch.arange(6, dtype=torch.float32)
    for out in shared["outputs"]:
        torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_reference_torch_devices_one_loop_per_group() -> None:
    # The reference the patch is measured against: without it, every group brings its own loop thread.
    before = _loop_threads()
    with one_gloo_device(2, "gloo") as applied:  # several ranks: torch's devices
        assert not applied
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        try:
            torch_devices = _groups_and_collectives()
        finally:
            dist.destroy_process_group()
    assert torch_devices["patched"] == "ProcessGroupGloo"
    assert torch_devices["loops"] - before == GROUPS + 1
    for out in torch_devices["outputs"]:
        torch.testing.assert_close(out, torch.arange(6, dtype=torch.float32), rtol=0, atol=0)


def test_other_backends_are_left_alone() -> None:
    original = c10d.ProcessGroupGloo
    with one_gloo_device(1, "mpi") as applied:
        assert not applied
        assert c10d.ProcessGroupGloo is original
