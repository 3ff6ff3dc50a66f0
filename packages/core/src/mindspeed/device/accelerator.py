"""The accelerator seam: one object per device family that answers every hardware question.

Only this package (and the vendor kernel backends under ``mindspeed.ops.backends``) names a
device family, a collective library or a vendor module. Everything else asks the accelerator
returned by :func:`get_accelerator`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed.registry import Registry

logger = get_logger(__name__)

#: Environment variable that forces an accelerator by name ("cpu", "cuda", "npu").
ACCELERATOR_ENV = "MINDSPEED_ACCELERATOR"


class Accelerator:
    """Base class of a device family; subclasses fill in the class attributes and probes.

    Attributes:
        name: the torch device type ("cpu", "cuda", "npu").
        dist_backend: torch.distributed backend for collectives on this device.
        visible_devices_env: environment variable that limits the visible devices ("" if none).
        ray_resource: Ray resource name that places a worker on one such device ("" = CPU only).
        priority: auto-detection order; the highest available one wins.
    """

    name: str = ""
    dist_backend: str = "gloo"
    visible_devices_env: str = ""
    ray_resource: str = ""
    priority: int = 0

    # -- probing ------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> bool:
        """Whether this device family is usable in this process."""
        raise NotImplementedError

    @property
    def torch_module(self) -> Any:
        """The ``torch.<name>`` module of the family (``None`` for the CPU)."""
        return None

    # -- devices ------------------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        """A ``torch.device`` of this family; ``index=None`` is the current device."""
        if index is None:
            return self.current_device()
        return torch.device(self.name, index)

    def current_device(self) -> torch.device:
        """The device this process computes on."""
        return torch.device(self.name, self.torch_module.current_device())

    def device_count(self) -> int:
        """How many devices of this family this process can see."""
        return self.torch_module.device_count()

    def set_device(self, local_rank: int) -> torch.device:
        """Bind this process to device ``local_rank`` and return it."""
        self.torch_module.set_device(local_rank)
        return self.current_device()

    def synchronize(self) -> None:
        """Wait for all queued work on the current device."""
        self.torch_module.synchronize()

    # -- randomness ---------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed the device generator of the current device."""
        self.torch_module.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        """The device generator state of the current device."""
        return self.torch_module.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state returned by :meth:`get_rng_state`."""
        self.torch_module.set_rng_state(state)

    @contextlib.contextmanager
    def fork_rng(self) -> Iterator[None]:
        """Run a block and restore the host and device generators afterwards."""
        host = torch.get_rng_state()
        device = self.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(host)
            self.set_rng_state(device)

    # -- memory -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        """Bytes in use: ``allocated``, ``reserved``, ``peak_allocated`` on the current device."""
        mod = self.torch_module
        return {
            "allocated": int(mod.memory_allocated()),
            "reserved": int(mod.memory_reserved()),
            "peak_allocated": int(mod.max_memory_allocated()),
        }

    def reset_peak_memory_stats(self) -> None:
        """Restart the ``peak_allocated`` counter."""
        self.torch_module.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        """Give cached, unused device memory back to the driver."""
        self.torch_module.empty_cache()

    def empty_host(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor for copies to and from the device (pinned where supported)."""
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.supports("pinned_memory"))

    # -- streams ------------------------------------------------------------------------
    def stream(self) -> Any:
        """A new side stream (for overlap and swapping)."""
        return self.torch_module.Stream()

    def current_stream(self) -> Any:
        """The stream work is queued on now."""
        return self.torch_module.current_stream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager that queues work on ``stream``."""
        return self.torch_module.stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        """A new event, to order streams or time work."""
        return self.torch_module.Event(enable_timing=enable_timing)

    # -- determinism ---------------------------------------------------------------------
    def deterministic_env(self) -> dict[str, str]:
        """Environment variables the family's libraries read to run deterministically.

        :func:`mindspeed.device.deterministic_mode` sets those that are unset (the libraries read
        them when they create their handles: launchers export them to the ranks too).
        """
        return {}

    def set_deterministic(self, enabled: bool) -> dict[str, Any]:
        """Switch the family's own deterministic settings beyond ``torch.use_deterministic_algorithms``.

        Returns:
            The previous values, for :meth:`restore_deterministic`.
        """
        return {}

    def restore_deterministic(self, previous: dict[str, Any]) -> None:
        """Put back what :meth:`set_deterministic` returned."""

    # -- distributed and placement -------------------------------------------------------
    def supports(self, capability: str) -> bool:
        """Whether a capability ("bf16", "fp8", "streams", "pinned_memory") is usable."""
        return capability in self.capabilities()

    def capabilities(self) -> frozenset[str]:
        """Every capability :meth:`supports` answers yes to."""
        return frozenset({"bf16", "streams", "pinned_memory"})

    def describe(self) -> dict[str, Any]:
        """A summary for ``mindspeed info`` and run reports."""
        return {
            "name": self.name,
            "dist_backend": self.dist_backend,
            "device_count": self.device_count(),
            "visible_devices_env": self.visible_devices_env or None,
            "ray_resource": self.ray_resource or None,
            "capabilities": sorted(self.capabilities()),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, dist_backend={self.dist_backend!r})"


ACCELERATORS: Registry[type[Accelerator]] = Registry("accelerator")


def register_accelerator(cls: type[Accelerator]) -> type[Accelerator]:
    """Class decorator that makes a device family known under ``cls.name``."""
    ACCELERATORS.register(cls.name, cls)
    return cls


_current: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator of this process, resolved once on first use.

    The ``MINDSPEED_ACCELERATOR`` environment variable forces a family by name; otherwise the
    available family with the highest priority wins (npu, then cuda, then cpu).
    """
    global _current
    if _current is None:
        _current = _resolve(os.environ.get(ACCELERATOR_ENV) or None)
        logger.info("accelerator: %s (distributed backend %s)", _current.name, _current.dist_backend)
    return _current


def set_accelerator(name: str | Accelerator | None) -> Accelerator:
    """Select the accelerator explicitly (from a config); ``None`` re-runs auto-detection.

    Raises:
        ValueError: if the family is unknown or not available in this process.
    """
    global _current
    _current = name if isinstance(name, Accelerator) else _resolve(name)
    logger.info("accelerator set to %s", _current.name)
    return _current


def _resolve(name: str | None) -> Accelerator:
    if name is not None:
        cls = ACCELERATORS.get(name)
        if not cls.is_available():
            raise ValueError(
                f"accelerator {name!r} was requested (argument or {ACCELERATOR_ENV}) but is not "
                f"available in this process; available: {', '.join(available_accelerators())}"
            )
        return cls()
    candidates = sorted((cls for _, cls in ACCELERATORS.items()), key=lambda c: -c.priority)
    for cls in candidates:
        if cls.is_available():
            return cls()
    raise RuntimeError("no accelerator is available, not even the CPU")  # the CPU always is


def available_accelerators() -> list[str]:
    """Names of the device families usable in this process, best first."""
    classes = sorted((cls for _, cls in ACCELERATORS.items()), key=lambda c: -c.priority)
    return [cls.name for cls in classes if cls.is_available()]
