"""One gloo transport device for all the process groups of a one-rank run.

torch gives every gloo process group its own TCP device, and every device runs a
``gloo_tcp_loop`` thread that wakes from ``epoll_wait`` every 10 ms whether or not anything
is sent. megatron-core's ``initialize_model_parallel`` creates about twenty groups (tensor,
pipeline, data, context, expert, embedding, their combinations and gloo copies), so a one-rank
CPU run keeps ~20 threads waking ~2,000 times a second: 10-13 ms of CPU a second (about 1 % of
a tiny pretrain step) and as many interruptions of the compute threads on a small host.

A one-rank run has no peers: its collectives never touch the transport. :func:`one_gloo_device`
makes every gloo group created inside it share one device (the one torch would create first:
``GLOO_SOCKET_IFNAME`` is honoured as torch honours it), so one loop thread wakes instead of
twenty. The collectives give the same results (a one-rank all-reduce, all-gather, broadcast or
barrier copies or does nothing, on whatever device). Runs of several ranks keep torch's devices.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from mindspeed.log import get_logger
from mindspeed.patching import PatchError, UpstreamPatch

logger = get_logger(__name__)

#: torch versions whose ``ProcessGroupGloo`` construction (``distributed_c10d._new_process_group_helper``) was read.
GLOO_DEVICE_VERSIONS = ">=2.6,<2.14"
_TARGET = "torch.distributed.distributed_c10d.ProcessGroupGloo"


def _devices(gloo: Any) -> list[Any]:
    # As torch's ProcessGroupGloo(store, rank, size, timeout) picks them: one per GLOO_SOCKET_IFNAME interface, or
    # the default one.
    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(names) > 1:
        return [gloo.create_device(interface=name) for name in names.split(",")]
    return [gloo.create_default_device()]


def _shared_device_gloo(original: Any, _accelerator: Any) -> Any:
    devices = _devices(original)

    class SharedDeviceGloo(original):  # type: ignore[misc, valid-type]
        """``ProcessGroupGloo`` on the run's one device (same constructor as torch calls)."""

        def __init__(self, store: Any, rank: int, size: int, timeout: timedelta = timedelta(minutes=30)) -> None:
            options = original._Options()
            options._timeout = timeout
            options._devices = devices
            options._threads = 2 * len(devices)  # torch's default: two worker threads per device
            super().__init__(store, rank, size, options)

    return SharedDeviceGloo


def shared_device_patch() -> UpstreamPatch:
    """The patch :func:`one_gloo_device` applies (a fresh one: a patch is applied once)."""
    return UpstreamPatch(
        "one-gloo-device",
        _TARGET,
        _shared_device_gloo,
        distribution="torch",
        versions=GLOO_DEVICE_VERSIONS,
        reason="every gloo group gets its own TCP device whose loop thread wakes every 10 ms; a one-rank run "
        "has no peers, so its ~20 groups can share one",
    )


@contextlib.contextmanager
def one_gloo_device(world_size: int, backend: str) -> Iterator[bool]:
    """Inside: the gloo process groups this process creates share one TCP device, if ``world_size`` is 1.

    Yields whether it did (no for several ranks, another backend, or a torch outside
    :data:`GLOO_DEVICE_VERSIONS`: then torch's own devices, logged once). Reverted on exit; groups
    created inside keep their device until they are destroyed.
    """
    if world_size != 1 or backend != "gloo":
        yield False
        return
    patch = shared_device_patch()
    try:
        patch.apply(None)
    except PatchError as err:
        logger.info("gloo: one device per process group (%s)", err)
        yield False
        return
    logger.debug("gloo: %s (%s)", patch.name, patch.reason)
    try:
        yield True
    finally:
        patch.revert()
