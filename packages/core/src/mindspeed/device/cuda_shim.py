"""Make code written for CUDA (megatron-core) run on another accelerator.

Two pieces, both explicit and reversible, used by ``mindspeed.megatron.adapt``:

- :func:`cuda_api_patches`: ``torch.cuda.*`` functions that megatron-core calls directly
  (current_device, synchronize, RNG state, streams, events, memory stats) are replaced by
  the selected accelerator's answers.
- :class:`DeviceRedirectMode`: a ``TorchFunctionMode`` that rewrites device arguments
  (``device="cuda"``, ``cuda:N``, a bare index, ``tensor.cuda()``, ``tensor.to("cuda")``)
  to the accelerator's device, and makes ``tensor.type()`` report the ``torch.cuda.*``
  names that megatron-core's dtype checks expect. The same idea as torch_npu's
  ``transfer_to_npu``, but entered by a call, per thread, and left by another.
- :class:`DeviceMappedTorch`: the ``torch`` namespace as one upstream module sees it, with the
  tensor factories' CUDA device arguments mapped to the accelerator: patched in as that
  module's ``torch`` global, it fixes the module's ``device="cuda"`` call sites without a
  function mode, so code that runs every step pays nothing for the modules it does not touch.

On CUDA itself nothing is needed and nothing is applied.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mindspeed.device.accelerator import Accelerator
from mindspeed.patching import UpstreamPatch

#: torch versions these redirects were written and checked for.
TORCH_VERSIONS = ">=2.6,<2.14"
#: Accelerators on which CUDA-only code needs the redirects (CUDA itself runs it natively).
SHIMMED_ACCELERATORS = ("cpu", "npu")
_NOT_CUDA = SHIMMED_ACCELERATORS


def needs_cuda_shim(accelerator: Accelerator) -> bool:
    """Whether code written for CUDA needs the redirects to run on ``accelerator``."""
    return accelerator.name in SHIMMED_ACCELERATORS


def _redirect(
    name: str, make: Callable[[Any, Accelerator], Any], reason: str, module: str = "torch.cuda"
) -> UpstreamPatch:
    return UpstreamPatch(
        name=f"cuda-api:{name}",
        target=f"{module}.{name}",
        make=make,
        distribution="torch",
        versions=TORCH_VERSIONS,
        reason=reason,
        accelerators=_NOT_CUDA,
    )


def _memory(key: str) -> Callable[[Any, Accelerator], Any]:
    return lambda original, acc: lambda device=None: acc.memory_stats()[key]


def cuda_api_patches() -> list[UpstreamPatch]:
    """The ``torch.cuda`` functions megatron-core calls, redirected to the accelerator."""
    return [
        _redirect(
            "current_device",
            lambda o, acc: lambda: acc.current_device(),
            "175 call sites in megatron-core allocate on torch.cuda.current_device()",
        ),
        _redirect("device_count", lambda o, acc: lambda: acc.device_count(), "device discovery"),
        _redirect("set_device", lambda o, acc: lambda device: acc.set_device(_index(device)), "rank binding"),
        _redirect("synchronize", lambda o, acc: lambda device=None: acc.synchronize(), "timers and p2p"),
        _redirect("empty_cache", lambda o, acc: lambda: acc.empty_cache(), "memory release"),
        _redirect("manual_seed", lambda o, acc: lambda seed: acc.manual_seed(int(seed)), "RNG tracker seeding"),
        _redirect("manual_seed_all", lambda o, acc: lambda seed: acc.manual_seed(int(seed)), "RNG seeding"),
        _redirect("get_rng_state", lambda o, acc: lambda device="cuda": acc.get_rng_state(), "RNG tracker"),
        _redirect(
            "set_rng_state", lambda o, acc: lambda new_state, device="cuda": acc.set_rng_state(new_state), "RNG tracker"
        ),
        _redirect(
            "get_rng_state",
            lambda o, acc: lambda device="cuda": acc.get_rng_state(),
            "megatron's _get_cuda_rng_state calls torch.cuda.random.get_rng_state",
            module="torch.cuda.random",
        ),
        _redirect("current_stream", lambda o, acc: lambda device=None: acc.current_stream(), "stream ordering"),
        _redirect("default_stream", lambda o, acc: lambda device=None: acc.current_stream(), "stream ordering"),
        _redirect(
            "Stream",
            lambda o, acc: _factory_type("Stream", lambda *args, **kwargs: acc.stream()),
            "the MoE alltoall dispatcher and overlap code create side streams",
        ),
        _redirect("stream", lambda o, acc: lambda stream: acc.use_stream(stream), "stream context"),
        _redirect(
            "Event",
            lambda o, acc: _factory_type("Event", lambda enable_timing=False, **kwargs: acc.event(enable_timing)),
            "timers and stream ordering",
        ),
        _redirect("memory_allocated", _memory("allocated"), "memory reports"),
        _redirect("max_memory_allocated", _memory("peak_allocated"), "memory reports"),
        _redirect("memory_reserved", _memory("reserved"), "memory reports"),
        _redirect(
            "reset_peak_memory_stats",
            lambda o, acc: lambda device=None: acc.reset_peak_memory_stats(),
            "memory reports",
        ),
    ]


def _factory_type(name: str, make: Callable[..., Any]) -> type:
    """A class whose construction returns ``make(...)``: code that uses ``torch.cuda.Stream``
    as a type (annotations such as ``Optional[torch.cuda.Stream]`` in transformers) keeps working."""
    return type(
        name,
        (),
        {
            "__new__": staticmethod(lambda cls, *args, **kwargs: make(*args, **kwargs)),
            "__doc__": f"Stands in for torch.cuda.{name} on another accelerator.",
        },
    )


def _index(device: Any) -> int:
    if isinstance(device, torch.device):
        return device.index or 0
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else 0
    return int(device)


#: Functions whose positional arguments may name a device or a CUDA type.
_REWRITTEN = frozenset({torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to})


class DeviceRedirectMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to ``accelerator``'s device (thread-local; enter per thread).

    Args:
        accelerator: where tensors should go instead of CUDA.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        super().__init__()
        self.accelerator = accelerator
        # Tensor.type() prefix the accelerator reports, e.g. "torch." on the CPU, "torch.npu.".
        self._type_prefix = "torch." if accelerator.name == "cpu" else f"torch.{accelerator.name}."

    def map_device(self, device: Any) -> Any:
        """The accelerator device for a CUDA device spec; anything else unchanged."""
        if isinstance(device, bool):
            return device
        if isinstance(device, int):
            return self.accelerator.device(device)
        if isinstance(device, str) and device.split(":")[0] == "cuda":
            return self.accelerator.device(_index(device) if ":" in device else None)
        if isinstance(device, torch.device) and device.type == "cuda":
            return self.accelerator.device(device.index)
        return device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not kwargs and func not in _REWRITTEN:  # most calls (every op of a forward): nothing to rewrite
            return func(*args)
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            tensor = args[0]
            target = self.map_device(args[1] if len(args) > 1 else kwargs.get("device", 0))
            return (
                tensor if tensor.device == target else tensor.to(target, non_blocking=kwargs.get("non_blocking", False))
            )
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            # megatron-core checks param.type() against "torch.cuda.FloatTensor" and friends.
            return "torch.cuda." + name[len(self._type_prefix) :] if name.startswith(self._type_prefix) else name
        if "device" in kwargs:
            kwargs["device"] = self.map_device(kwargs["device"])
        if kwargs.get("pin_memory") and not self.accelerator.supports("pinned_memory"):
            # Pinning only speeds host-to-device copies; without a device it would need a CUDA
            # driver (megatron's CP rope slice asks for it), so drop it: no value changes.
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], self.map_device(args[1]), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def redirect_suspended() -> Iterator[None]:
    """Leave the calling thread's :class:`DeviceRedirectMode` for the duration (no-op without one).

    The redirect sees every torch call (~10 us each in Python): code that never names a CUDA
    device (the inference engine's decode loop, registry kernels) runs much faster outside it.
    Only a redirect at the top of the thread's function-mode stack is left; any other mode stays.
    """
    mode = None
    if torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if isinstance(top, DeviceRedirectMode):
            mode = top
        else:
            torch._C._push_on_torch_function_stack(top)
    try:
        yield
    finally:
        if mode is not None:
            torch._C._push_on_torch_function_stack(mode)


#: The tensor factories whose ``device=`` :class:`DeviceMappedTorch` maps (megatron-core's
#: ``device="cuda"`` sites call these; the rest of ``torch`` is passed through untouched).
MAPPED_FACTORIES = (
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "randn",
    "rand",
    "randint",
)


def map_cuda_device(device: Any, accelerator: Accelerator) -> Any:
    """``accelerator``'s device for a CUDA device spec (``"cuda"``, ``"cuda:N"``, a CUDA
    ``torch.device``); anything else unchanged (``None``, ``"cpu"``, indices of other APIs)."""
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return accelerator.device(_index(device) if ":" in device else None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return accelerator.device(device.index)
    return device


class DeviceMappedTorch(types.ModuleType):
    """``torch`` for one upstream module, with CUDA ``device=`` arguments of the tensor factories
    mapped to ``accelerator`` (and ``pin_memory`` dropped where it cannot pin).

    Every other attribute is ``torch``'s own, read at each access (so later patches of ``torch``
    are seen). Patch it in as a module's ``torch`` global (an ``UpstreamPatch`` whose target is
    ``"package.module.torch"``): the module's call sites that write ``device="cuda"`` then run on
    the accelerator without a torch function mode, at the cost of one Python call per factory
    call of that module only.

    Args:
        accelerator: where tensors go instead of CUDA.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        super().__init__("torch", "torch with CUDA device arguments mapped to " + accelerator.name)
        self.accelerator = accelerator
        pinning = accelerator.supports("pinned_memory")
        for name in MAPPED_FACTORIES:
            setattr(self, name, _mapped_factory(getattr(torch, name), accelerator, pinning))

    def __getattr__(self, name: str) -> Any:
        # Only called for what the instance does not hold: everything but the mapped factories.
        return getattr(torch, name)


def _mapped_factory(factory: Callable[..., Any], accelerator: Accelerator, pinning: bool) -> Callable[..., Any]:
    @functools.wraps(factory)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = map_cuda_device(kwargs["device"], accelerator)
        if not pinning and kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    return mapped
