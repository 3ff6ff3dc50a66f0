"""``impl="compile"``: the reference implementation compiled with ``torch.compile``.

Available wherever torch.compile works (inductor needs a C++ compiler on the CPU, Triton on
CUDA). Priority -1: never chosen by ``impl="auto"`` because the first call pays the
compilation; ask for it by name where a step runs long enough to amortise it.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from typing import Any

import torch

from mindspeed.ops.registry import OPS, register_kernel

#: Ops whose reference is a pure elementwise/reduction graph that inductor fuses well.
COMPILED_OPS = ("rms_norm", "layer_norm", "swiglu", "rotary_pos_emb", "ring_attention_update")


def _compiler_present() -> bool:
    # Inductor's CPU backend shells out to a C++ compiler; without one every call would fail.
    return shutil.which("g++") is not None or shutil.which("c++") is not None or shutil.which("clang++") is not None


def _compiled(reference: Callable[..., Any]) -> Callable[..., Any]:
    compiled = None

    @functools.wraps(reference)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:  # compile lazily: registering must not start inductor
            compiled = torch.compile(reference, dynamic=True)
        return compiled(*args, **kwargs)

    return call


def register_compiled_kernels() -> None:
    """Register ``compile`` implementations of every op in :data:`COMPILED_OPS` that is declared."""
    for op in COMPILED_OPS:
        if op in OPS:
            register_kernel(op, "compile", priority=-1, available=_compiler_present)(_compiled(OPS.get(op).reference))
