"""The report of the active ``adapt()`` and the kernel defaults it implies for specs and MoE modules.

A leaf module: ``adaptor`` records the report here, ``spec`` and ``moe`` read it, so neither of
them imports the adaptor (which imports both to install their patches).
"""

from __future__ import annotations

from typing import Any

_report: Any = None


def set_current_report(report: Any) -> None:
    """Record the report of the adaptation now active (``None`` when it is undone); ``adaptor`` only."""
    global _report
    _report = report


def current_report() -> Any:
    """The :class:`~mindspeed.megatron.adaptor.AdaptReport` of the active adaptation, if any."""
    return _report


def default_impl(op: str) -> str:
    """The implementation of ``op`` chosen by the features of the active ``adapt()``, else "auto"."""
    if _report is not None and _report.context is not None:
        return _report.context.kernel_for(op)
    return "auto"


def grouped_gemm_enabled() -> bool:
    """Whether the active ``adapt()`` turned the ``moe_grouped_gemm`` feature on."""
    return _report is not None and _report.context is not None and "grouped_matmul" in _report.context.kernel_impls
