"""The report of the active ``adapt()``: whether megatron-core is adapted in this process.

A leaf module the adaptor records its report in. Builders never read it: they take the
report's ``kernels`` as an argument (``get_gpt_layer_spec(report.kernels)``); it answers only
"is megatron-core adapted, and with which features" (one adaptation per process).
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
