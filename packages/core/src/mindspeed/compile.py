"""Regional compilation (``train.compile``): ``torch.compile`` of each repeated block's ``forward``, as torchtitan does.

Shared by the suites: the LLM trainer compiles megatron-core's ``TransformerLayer``\\ s
(``mindspeed_llm.training.compile``), the MM suite the repeated blocks of a diffusers transformer
(``mindspeed_mm.models.dit_compile``). :func:`compile_forwards` replaces each module's ``forward``
in place (``fullgraph=True``, static shapes), so the module hooks that DDP/FSDP, recompute and the
task add stay outside the compiled region, the parameter names (checkpoints, exports) do not
change, and the blocks of one class share one graph (same code, same shapes).

:class:`CompileWatch` scopes dynamo's process-wide counters to a run: the frames (graphs) compiled
since it started and the seconds spent compiling, which the trainers log and report, and which the
tests use to prove that no step after the first compiles again.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: ``train.compile`` values (``true`` is ``default``) and the ``torch.compile`` mode each runs (no CUDA graphs: the
#: DDP/FSDP hooks between blocks and the changing microbatches do not fit them).
MODES = {"default": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def compile_mode(value: bool | str) -> str | None:
    """The :data:`MODES` key of a ``train.compile`` value (``None`` for ``False``).

    Raises:
        ValueError: an unknown mode.
    """
    if value is False or value is None:
        return None
    mode = "default" if value is True else value
    if mode not in MODES:
        raise ValueError(f"train.compile={value!r}: use true, false or {', '.join(MODES)}")
    return mode


def compile_forwards(
    modules: Iterable[tuple[str, torch.nn.Module]],
    mode: str,
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    method: str = "forward",
) -> list[str]:
    """Compile the ``forward`` (or ``method``) of every ``(name, module)`` in place (``mode``: a key of :data:`MODES`).

    Args:
        modules: ``(name, module)`` pairs.
        mode: a key of :data:`MODES`.
        prepare: runs eagerly on each call's keyword arguments before the compiled forward and
            returns the ones it gets (``mindspeed.megatron.compiled_packing``: packed microbatches
            as tensors of the token count, so the graph neither breaks nor recompiles on them).
        method: the bound method compiled instead of ``forward`` (megatron's MoE layers compile
            ``_forward_attention``: the token dispatch after it sizes its buffers on the host).

    Returns:
        the compiled modules' names.
    """
    names = []
    for name, module in modules:
        compiled = torch.compile(getattr(module, method), mode=MODES[mode], fullgraph=True, dynamic=False)
        setattr(module, method, _ignoring_warnings(compiled, prepare))
        names.append(name)
    return names


def _ignoring_warnings(compiled: Any, prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Any:
    """``compiled`` with ``warnings.warn`` dropped from the traced code: dynamo cannot trace the C builtin
    (megatron-core warns of deprecations inside its linear layers), and would break the full graph on it."""
    patch = torch._dynamo.config.patch(ignore_logging_functions={warnings.warn})

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if prepare is not None:
            kwargs = prepare(kwargs)
        with patch:
            return compiled(*args, **kwargs)

    return forward


class CompileWatch:
    """Dynamo's process-wide counters since this watch started (other runs in the process compile too)."""

    def __init__(self) -> None:
        self._graphs, self._seconds = _graphs(), _compile_seconds()

    def graphs(self) -> int:
        """Graphs (frames) dynamo compiled since the watch started."""
        return _graphs() - self._graphs

    def seconds(self) -> float:
        """Seconds dynamo and Inductor spent compiling since the watch started."""
        return _compile_seconds() - self._seconds


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_seconds() -> float:
    from torch._dynamo.utils import compilation_time_metrics

    # dynamo's trace and the forward's Inductor compile; AOTAutograd compiles the backward lazily, in the first backward.
    keys = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    return float(sum(sum(compilation_time_metrics.get(key, ())) for key in keys))
