"""Peak-memory measurement: expected peaks follow from the shapes the tests allocate."""

from __future__ import annotations

import gc

import pytest
import torch

from mindspeed.device import get_accelerator
from mindspeed.metrics import measure_peak_memory

N = 1 << 20  # elements of the main test tensor: 4 MiB in fp32


def _bytes(numel: int, dtype: torch.dtype = torch.float32) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


def test_single_allocation() -> None:
    with measure_peak_memory(method="dispatch") as mem:
        x = torch.empty(N)
    assert mem.method == "dispatch"
    assert mem.peak_bytes == _bytes(N) == x.untyped_storage().nbytes()
    assert mem.peak_mib == pytest.approx(_bytes(N) / 2**20)
    assert mem.end_bytes == _bytes(N)


def test_freed_temporary_then_smaller_one() -> None:
    small = N // 4
    with measure_peak_memory(method="dispatch") as mem:
        tmp = torch.empty(N)
        del tmp  # its storage must be subtracted before the next allocation
        keep = torch.empty(small, dtype=torch.bfloat16)
    assert mem.peak_bytes == _bytes(N)
    assert mem.end_bytes == _bytes(small, torch.bfloat16) == keep.untyped_storage().nbytes()


def test_chain_frees_its_intermediate() -> None:
    x = torch.randn(N)
    with measure_peak_memory(method="dispatch") as mem:
        y = x * 2 + 1  # x * 2 lives until the add has produced its output
    assert mem.peak_bytes == 2 * _bytes(x.numel())
    assert mem.end_bytes == _bytes(y.numel())


def test_views_and_splits_are_not_new_memory() -> None:
    with measure_peak_memory(method="dispatch") as mem:
        a = torch.empty(N)
        parts = a.view(4, -1).t().split(1, dim=1)
        a.add_(1.0)  # in place: same storage
    assert len(parts) == 4
    assert mem.peak_bytes == _bytes(N)


def test_resize_grows_the_count() -> None:
    with measure_peak_memory(method="dispatch") as mem:
        a = torch.empty(N // 2)
        a.resize_(N)
    assert mem.peak_bytes == _bytes(N)
    assert mem.end_bytes == _bytes(N)


def test_resize_of_an_older_tensor_counts_its_growth() -> None:
    a = torch.empty(N // 2)
    with measure_peak_memory(method="dispatch") as mem:
        a.resize_(N)
        a.add_(1.0)  # in place again: no further change
    assert mem.peak_bytes == mem.end_bytes == _bytes(N) - _bytes(N // 2)


def test_freeing_an_older_tensor_lowers_the_live_total() -> None:
    # Like a device allocator, freeing memory that existed at entry makes room below the baseline.
    x = torch.randn(N)
    with measure_peak_memory(method="dispatch") as mem:
        y = x + 1
        del x
        z = torch.empty(N)
    assert mem.peak_bytes == _bytes(N)
    assert mem.end_bytes == _bytes(y.numel()) + _bytes(z.numel()) - _bytes(N)


def test_torch_tensor_is_counted() -> None:
    values = [float(i) for i in range(1000)]
    with measure_peak_memory(method="dispatch") as mem:
        t = torch.tensor(values, dtype=torch.float64)
        u = t + 1
        del t
    assert mem.peak_bytes == 2 * _bytes(len(values), torch.float64)
    assert mem.end_bytes == _bytes(u.numel(), torch.float64)


def _forward_backward(x: torch.Tensor) -> None:
    # sin saves its input, so the graph holds one N-sized tensor besides the output.
    loss = (x * 2).sin().sum()
    loss.backward()


def test_forward_backward_through_autograd() -> None:
    x = torch.randn(N, requires_grad=True)
    with measure_peak_memory(method="dispatch") as mem:
        _forward_backward(x)
        gc.collect()
    n = _bytes(N)
    # Forward: x * 2 (saved by sin) and sin's output are alive together; backward then needs
    # cos(x * 2) and the product with the incoming gradient before x * 2 is released.
    assert 3 * n <= mem.peak_bytes <= 5 * n
    # Everything the graph saved is freed again: only x.grad is left.
    assert x.grad is not None
    assert mem.end_bytes == x.grad.untyped_storage().nbytes() == n


def test_nothing_is_counted_after_exit() -> None:
    with measure_peak_memory(method="dispatch") as mem:
        a = torch.empty(N)
    peak, end = mem.peak_bytes, mem.end_bytes
    b = torch.empty(2 * N)
    del a, b
    assert (mem.peak_bytes, mem.end_bytes) == (peak, end)


def test_auto_picks_by_accelerator() -> None:
    with measure_peak_memory() as mem:
        torch.empty(16)
    expected = "dispatch" if get_accelerator().torch_module is None else "allocator"
    assert mem.method == expected


def test_unknown_method_is_rejected() -> None:
    with pytest.raises(ValueError, match="dispatch"):
        with measure_peak_memory(method="rss"):
            pass


@pytest.mark.skipif(get_accelerator().torch_module is None, reason="needs a device with a caching allocator")
def test_allocator_agrees_with_dispatch_tracking() -> None:
    device = get_accelerator().device()
    x = torch.randn(N, device=device)
    peaks = {}
    for method in ("allocator", "dispatch"):
        with measure_peak_memory(method=method) as mem:
            y = x * 2 + 1
        peaks[method] = mem.peak_bytes
        del y
    assert peaks["allocator"] == peaks["dispatch"] == 2 * _bytes(N)


def test_from_empty_ignores_storages_it_did_not_see_allocated() -> None:
    # A buffer made outside the dispatcher inside the block (as gloo's reduce-scatter makes one
    # in C++), used by an op and freed: a tracker started from an empty pool must not count its
    # free (the default tracker takes it for memory from before entry and goes below zero).
    from mindspeed.metrics.memory import StorageTracker, untracked

    for from_empty, expected in ((True, 0), (False, -4096)):
        tracker = StorageTracker(from_empty=from_empty)
        with tracker:
            with untracked():
                foreign = torch.zeros(1024)
            foreign.add_(1.0)
            kept = torch.ones(256)
            del foreign
            gc.collect()
            assert tracker.live_bytes == expected + kept.numel() * 4
        assert tracker.peak_bytes == 1024
