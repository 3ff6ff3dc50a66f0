"""The CPU: always available, collectives over gloo, no device memory of its own."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from mindspeed.device.accelerator import Accelerator, register_accelerator


class _NullStream:
    """Stand-in for a device stream on the CPU: work is synchronous, so waiting is a no-op."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event or _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    """Stand-in for a device event on the CPU."""

    def __init__(self, enable_timing: bool = False) -> None:
        self._time = None

    def record(self, stream: Any = None) -> None:
        import time

        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _NullEvent) -> float:
        """Milliseconds between this event and ``end``."""
        return (end._time - self._time) * 1000.0


def _read_status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (0 where procfs is absent, e.g. macOS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@register_accelerator
class CpuAccelerator(Accelerator):
    """The host CPU; the embedded default that every test runs on."""

    name = "cpu"
    dist_backend = "gloo"
    visible_devices_env = ""
    ray_resource = ""
    priority = 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")  # one host device, whatever the index

    def device_count(self) -> int:
        return 1

    def set_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        # The generator itself, not torch.manual_seed: that one also seeds every device family,
        # which would recurse when torch.cuda.manual_seed_all is redirected here.
        torch.default_generator.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def memory_stats(self) -> dict[str, int]:
        # The host has no caching allocator: report the process' resident set size and its peak.
        rss = _read_status_kib("VmRSS") * 1024
        return {"allocated": rss, "reserved": rss, "peak_allocated": _read_status_kib("VmHWM") * 1024}

    def reset_peak_memory_stats(self) -> None:
        # Linux resets VmHWM when "5" is written to clear_refs; silently skip elsewhere.
        with contextlib.suppress(OSError):
            with open(f"/proc/{os.getpid()}/clear_refs", "w") as refs:
                refs.write("5")

    def empty_cache(self) -> None:
        pass

    def stream(self) -> Any:
        return _NullStream()

    def current_stream(self) -> Any:
        return _NullStream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def event(self, enable_timing: bool = False) -> Any:
        return _NullEvent(enable_timing)

    def capabilities(self) -> frozenset[str]:
        return frozenset({"bf16"})
