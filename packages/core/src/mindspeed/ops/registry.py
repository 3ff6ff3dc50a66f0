"""The kernel registry: every op has a pure-PyTorch reference and optional faster backends.

An op is declared once with :func:`register_op` (its reference implementation and the sample
inputs that parity tests and benchmarks use). Backends add implementations with
:func:`register_kernel`, naming the accelerators they run on, a priority and a probe that says
whether their library is importable. :func:`resolve_kernel` picks one implementation at build
time (``impl="auto"``: the best available; ``"reference"``; or a backend by name) and logs the
choice once; there is no per-call dispatch and nothing is patched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger, log_once
from mindspeed.registry import Registry

logger = get_logger(__name__)

ANY_DEVICE = "*"
REFERENCE = "reference"


def _always() -> bool:
    return True


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of an op.

    Attributes:
        op: the op's name.
        name: the implementation's name ("reference", "native", "compile", "npu", "flash_attn", ...).
        fn: the callable; same signature and semantics as the op's reference.
        devices: accelerator names it runs on (``("*",)`` for any).
        priority: higher wins under ``impl="auto"``; the reference has priority 0.
        available: probe, called at resolve time (e.g. "is flash_attn importable").
        features: optional features it supports (e.g. ``{"lse", "varlen"}``); ``None`` = all.
        traceable: whether ``torch.compile`` can trace it into a graph; one that cannot (it writes
            into views with ``out=``, or calls a library dynamo does not know) runs the op's
            reference while dynamo traces (``train.compile``), which Inductor then fuses.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    devices: tuple[str, ...] = (ANY_DEVICE,)
    priority: int = 0
    available: Callable[[], bool] = _always
    features: frozenset[str] | None = None
    traceable: bool = True

    def runs_on(self, device: str) -> bool:
        """Whether this implementation runs on accelerator ``device``."""
        return ANY_DEVICE in self.devices or device in self.devices

    def supports(self, features: Iterable[str]) -> bool:
        """Whether every one of ``features`` is supported."""
        return self.features is None or set(features) <= self.features

    def is_available(self) -> bool:
        """Whether the probe says its library is usable here (a failing probe counts as no)."""
        try:
            return bool(self.available())
        except Exception:  # a probe that breaks means the backend is unusable, not a crash
            return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.traceable and torch.compiler.is_compiling():  # a constant while dynamo traces
            return OPS.get(self.op).reference(*args, **kwargs)
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance of a comparison against the reference."""

    atol: float
    rtol: float


#: Default parity tolerances per dtype; an op may tighten or loosen them.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
}


@dataclass(frozen=True)
class Case:
    """Sample inputs of an op for parity tests and benchmarks.

    Attributes:
        name: short description ("odd shape", "gqa causal", ...).
        args: positional arguments (tensors are cloned for every implementation run).
        kwargs: keyword arguments.
        features: features the call needs (an implementation must support them to be compared).
        grad: whether to compare input gradients too (a backward of a random projection of
            every floating output).
    """

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    features: frozenset[str] = frozenset()
    grad: bool = True


@dataclass(frozen=True)
class OpSpec:
    """An op: its reference, its docs and the sample inputs that prove its implementations.

    Attributes:
        name: registry key.
        reference: the pure-PyTorch implementation, always available.
        doc: one line for ``mindspeed info`` and the docs.
        cases: ``cases(dtype, device) -> list[Case]`` for parity tests (small, odd shapes too).
        bench_case: ``bench_case(dtype, device) -> Case`` of a realistic size for the benchmark.
        naive: the naive PyTorch version the benchmark measures against (default: reference).
        tolerances: per-dtype overrides of :data:`DEFAULT_TOLERANCES`.
        dtypes: dtypes the parity tests run.
    """

    name: str
    reference: Callable[..., Any]
    doc: str
    cases: Callable[[torch.dtype, torch.device], list[Case]]
    bench_case: Callable[[torch.dtype, torch.device], Case] | None = None
    naive: Callable[..., Any] | None = None
    tolerances: dict[torch.dtype, Tolerance] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        """The tolerance for comparing outputs of ``dtype`` with the reference."""
        return self.tolerances.get(dtype, DEFAULT_TOLERANCES[dtype])


OPS: Registry[OpSpec] = Registry("op")
KERNELS: Registry[KernelImpl] = Registry("kernel")  # key: (op, impl name)


def register_op(spec: OpSpec) -> OpSpec:
    """Declare an op; its reference is registered as implementation ``"reference"``."""
    OPS.register(spec.name, spec)
    KERNELS.register((spec.name, REFERENCE), KernelImpl(op=spec.name, name=REFERENCE, fn=spec.reference))
    return spec


def register_kernel(
    op: str,
    name: str,
    *,
    devices: Sequence[str] = (ANY_DEVICE,),
    priority: int = 10,
    available: Callable[[], bool] = _always,
    features: Iterable[str] | None = None,
    traceable: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that adds implementation ``name`` of ``op``.

    Args:
        op: a registered op's name.
        name: the implementation's name, unique per op.
        devices: accelerator names it runs on.
        priority: higher is preferred under ``impl="auto"`` (reference: 0).
        available: probe for its library.
        features: the optional features it supports (``None``: all of them).
        traceable: ``False`` for a kernel dynamo cannot trace: the reference runs in its place
            inside a compiled region (:attr:`KernelImpl.traceable`).
    """
    OPS.get(op)  # fail early on a typo in the op name

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        impl = KernelImpl(
            op=op,
            name=name,
            fn=fn,
            devices=tuple(devices),
            priority=priority,
            available=available,
            features=None if features is None else frozenset(features),
            traceable=traceable,
        )
        KERNELS.register((op, name), impl)
        return fn

    return decorator


def list_kernels(op: str) -> list[KernelImpl]:
    """Every registered implementation of ``op``, best first."""
    OPS.get(op)
    impls = [impl for (name, _), impl in KERNELS.items() if name == op]
    return sorted(impls, key=lambda impl: -impl.priority)


def available_kernels(op: str, device: str | None = None, features: Iterable[str] = ()) -> list[KernelImpl]:
    """Implementations of ``op`` usable on ``device`` (default: the current accelerator), best first."""
    device = device or get_accelerator().name
    features = tuple(features)
    return [
        impl for impl in list_kernels(op) if impl.runs_on(device) and impl.supports(features) and impl.is_available()
    ]


def resolve_kernel(
    op: str, impl: str = "auto", *, device: str | None = None, features: Iterable[str] = ()
) -> KernelImpl:
    """Pick the implementation of ``op`` to use, once, at build time.

    Args:
        op: the op's name.
        impl: ``"auto"`` (best available), ``"reference"``, or an implementation name.
        device: accelerator name (default: the current accelerator).
        features: optional features the caller needs (e.g. ``("lse",)``).

    Raises:
        ValueError: if ``impl`` is unknown for ``op``, does not run on ``device``, is not
            installed, or lacks a requested feature.
    """
    device = device or get_accelerator().name
    features = tuple(features)
    if impl == "auto":
        chosen = available_kernels(op, device, features)[0]  # the reference is always there
        log_once(logger, f"kernel {op}: using {chosen.name!r} on {device} (auto)", detail=True)
        return chosen
    chosen = KERNELS.get((op, impl)) if (op, impl) in KERNELS else None
    if chosen is None:
        known = ", ".join(k.name for k in list_kernels(op))
        raise ValueError(f"unknown implementation {impl!r} of op {op!r}; known: {known} (or 'auto')")
    if not chosen.runs_on(device):
        raise ValueError(
            f"implementation {impl!r} of op {op!r} runs on {', '.join(chosen.devices)}, not on {device}; "
            f"use impl='auto' or one of: {', '.join(k.name for k in available_kernels(op, device))}"
        )
    if not chosen.supports(features):
        raise ValueError(
            f"implementation {impl!r} of op {op!r} does not support {sorted(set(features) - chosen.features)}; "
            "use impl='auto' or impl='reference'"
        )
    if not chosen.is_available():
        raise ValueError(
            f"implementation {impl!r} of op {op!r} is not available here (its library is missing or "
            f"fails to load); use impl='auto' or one of: {', '.join(k.name for k in available_kernels(op, device))}"
        )
    log_once(logger, f"kernel {op}: using {chosen.name!r} on {device}", detail=True)
    return chosen
