"""Peak FLOP/s of one accelerator, the denominator of MFU; a table, a host estimate, or the user's number.

MFU = achieved model FLOP/s (:mod:`mindspeed.metrics.flops`) / (devices x peak FLOP/s of one
device). The peak comes from, in order: the user's override; :data:`PEAK_TFLOPS`, matched by
the device name the accelerator reports (dense tensor-core numbers from the vendors'
datasheets, no sparsity); on the CPU, an estimate from ``/proc/cpuinfo`` (threads x clock x
FLOPs per cycle of the widest fused multiply-add the flags show). Every :class:`Peak` says
where its number came from, so a log can state its denominator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed.device import get_accelerator


@dataclass(frozen=True)
class PeakEntry:
    """One row of the table: a device-name fragment and its peak TFLOP/s per dtype.

    Attributes:
        match: case-insensitive fragment of the device name (rows are tried in order, so a
            more specific fragment comes first).
        tflops: dtype (``bf16``, ``fp16``, ``fp32``) -> dense peak TFLOP/s.
        source: where the numbers come from.
    """

    match: str
    tflops: dict[str, float]
    source: str


#: Dense peak TFLOP/s per device (no structured sparsity). Extend by adding a row.
PEAK_TFLOPS: tuple[PeakEntry, ...] = (
    PeakEntry("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}, "NVIDIA H100 PCIe datasheet"),
    PeakEntry("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, "NVIDIA H100 SXM datasheet"),
    PeakEntry("H800", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, "NVIDIA H800 SXM (H100 SXM compute)"),
    PeakEntry("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, "NVIDIA H200 SXM datasheet"),
    PeakEntry("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, "NVIDIA A100 datasheet"),
    PeakEntry("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, "NVIDIA A800 (A100 compute)"),
    PeakEntry("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}, "NVIDIA A10 datasheet"),
    PeakEntry("L40S", {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6}, "NVIDIA L40S datasheet"),
    PeakEntry("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}, "NVIDIA L4 datasheet"),
    PeakEntry("V100", {"fp16": 125.0, "fp32": 15.7}, "NVIDIA V100 SXM2 datasheet"),
    PeakEntry("Ascend910A", {"fp16": 256.0}, "Huawei Ascend 910 product page"),
)


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s of one device, and where the number came from.

    Attributes:
        tflops: peak TFLOP/s of one device.
        device: the device name it was found for.
        dtype: the dtype it applies to.
        source: ``override``, the table row's source, or the host estimate's formula.
    """

    tflops: float
    device: str
    dtype: str
    source: str

    def describe(self) -> str:
        """One line for a log: the denominator of MFU."""
        return f"{self.tflops:.4g} TFLOP/s per device ({self.device}, {self.dtype}; {self.source})"


def device_name(accelerator: Any = None) -> str:
    """The name the accelerator reports for its current device (the CPU's model name on a host)."""
    accelerator = accelerator or get_accelerator()
    if accelerator.name == "cpu":
        return _cpuinfo().get("model name", "cpu")
    try:
        return str(accelerator.torch_module().get_device_name(accelerator.current_device()))
    except (AttributeError, RuntimeError, TypeError):
        return accelerator.name


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return info
    for line in path.read_text(errors="replace").splitlines():
        if ":" in line:
            key, value = (part.strip() for part in line.split(":", 1))
            info.setdefault(key, value)
    return info


def cpu_peak(threads: int | None = None) -> tuple[float, str]:
    """An estimate of the host's fp32 peak TFLOP/s for ``threads`` threads, and its formula.

    FLOPs per cycle per core: 64 with AVX-512 (two 16-lane FMA units), 32 with AVX2 + FMA (two
    8-lane units), 8 otherwise; the clock is the model name's nominal GHz, else the current MHz.
    """
    import torch

    threads = threads or torch.get_num_threads()
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 8
    nominal = re.search(r"@\s*([\d.]+)\s*GHz", info.get("model name", ""))
    if nominal:
        ghz = float(nominal.group(1))
    else:
        try:
            ghz = float(info.get("cpu MHz", "2000")) / 1000.0
        except ValueError:
            ghz = 2.0
    tflops = threads * ghz * per_cycle / 1000.0
    return tflops, f"host estimate: {threads} threads x {ghz:.3g} GHz x {per_cycle} FLOP/cycle"


def lookup_peak(name: str, dtype: str) -> Peak | None:
    """The table's peak for a device name and dtype (``None`` when no row matches)."""
    folded = name.lower().replace(" ", "")
    for entry in PEAK_TFLOPS:
        if entry.match.lower().replace(" ", "") in folded and dtype in entry.tflops:
            return Peak(entry.tflops[dtype], name, dtype, entry.source)
    return None


def peak_flops(dtype: str = "bf16", override_tflops: float | None = None, accelerator: Any = None) -> Peak | None:
    """The peak of one device of the current accelerator for ``dtype``.

    Args:
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        override_tflops: the user's number; wins when given.
        accelerator: default: the current one.

    Returns:
        The peak, or ``None`` when the device is not in the table (MFU is then not reported).
    """
    accelerator = accelerator or get_accelerator()
    name = device_name(accelerator)
    if override_tflops is not None:
        return Peak(float(override_tflops), name, dtype, "override")
    if accelerator.name == "cpu":
        tflops, source = cpu_peak()
        return Peak(tflops, name, dtype, source)
    return lookup_peak(name, dtype)


def mfu(flops_per_s: float, peak: Peak | None, num_devices: int) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over ``num_devices`` x the peak (``None`` without a peak)."""
    if peak is None or peak.tflops <= 0 or num_devices < 1:
        return None
    return flops_per_s / (num_devices * peak.tflops * 1e12)


__all__ = ["PEAK_TFLOPS", "Peak", "PeakEntry", "cpu_peak", "device_name", "lookup_peak", "mfu", "peak_flops"]
