"""Record which functions reach the model builder of the one build sequence (tests only).

:func:`record_builds` wraps :func:`mindspeed_llm.training.build.build_model` (the model builder
that :func:`~mindspeed_llm.training.build.build_engine` calls) with a recorder that passes the
call through: a test that already builds a trainer or an RL actor reads, from the same run, who
called the builder (``["build", "build_engine"]`` when the build went through the one sequence)
and whether the model was trainable.
"""

from __future__ import annotations

import sys
from typing import Any


def record_builds() -> list[dict[str, Any]]:
    """Start recording this process's model builds; returns the list the records are appended to.

    Each record: ``{"callers": [caller, caller's caller], "trainable": bool}``.
    """
    from mindspeed_llm.training import build as build_module

    builds: list[dict[str, Any]] = []
    real = build_module.build_model

    def recorded(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        builds.append(
            {
                "callers": [caller.f_code.co_name, caller.f_back.f_code.co_name if caller.f_back else ""],
                "trainable": kwargs.get("trainable", True),
            }
        )
        return real(*args, **kwargs)

    build_module.build_model = recorded
    return builds
