"""Parity of kernel implementations against the reference, shared by tests and benchmarks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mindspeed.ops.registry import Case, KernelImpl, OpSpec


def flatten_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple/list/dict output, in a stable order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flatten_tensors(item)]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in flatten_tensors(value[key])]
    return []


def _clone_arg(value: Any, requires_grad: bool) -> Any:
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        if requires_grad and copy.is_floating_point():
            copy.requires_grad_(True)
        return copy
    if isinstance(value, (tuple, list)):
        return type(value)(_clone_arg(v, requires_grad) for v in value)
    return value


def run_case(impl: KernelImpl, case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Run ``impl`` on fresh copies of the case's inputs.

    Returns:
        The flattened outputs and, when ``case.grad``, the gradients of every floating input
        tensor for the loss ``sum(output * cotangent)`` with fixed random cotangents.
    """
    args = _clone_arg(case.args, case.grad)
    kwargs = {k: _clone_arg(v, case.grad) for k, v in case.kwargs.items()}
    outputs = flatten_tensors(impl(*args, **kwargs))
    grads: list[torch.Tensor | None] = []
    if case.grad:
        leaves = [t for t in flatten_tensors((args, kwargs)) if t.requires_grad]
        float_outs = [o for o in outputs if o.is_floating_point() and o.requires_grad]
        gen = torch.Generator().manual_seed(1234)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in float_outs)
        if float_outs:
            loss.backward()
        grads = [leaf.grad for leaf in leaves]
    return [o.detach() for o in outputs], grads


def compare_case(spec: OpSpec, impl: KernelImpl, reference: KernelImpl, case: Case, dtype: torch.dtype) -> list[str]:
    """Differences between ``impl`` and the reference on one case; empty when they agree."""
    tol = spec.tolerance(dtype)
    expected_out, expected_grads = run_case(reference, case)
    actual_out, actual_grads = run_case(impl, case)
    problems: list[str] = []
    pairs: Iterable[tuple[str, Any, Any]] = [
        *((f"output {i}", a, e) for i, (a, e) in enumerate(zip(actual_out, expected_out))),
        *((f"grad of input {i}", a, e) for i, (a, e) in enumerate(zip(actual_grads, expected_grads))),
    ]
    if len(actual_out) != len(expected_out):
        problems.append(f"{len(actual_out)} outputs, reference has {len(expected_out)}")
    for what, actual, expected in pairs:
        if (actual is None) != (expected is None):
            problems.append(f"{what}: {'missing' if actual is None else 'unexpected'}")
            continue
        if actual is None:
            continue
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            problems.append(
                f"{what}: {actual.dtype}{list(actual.shape)} vs reference {expected.dtype}{list(expected.shape)}"
            )
            continue
        if not actual.is_floating_point():
            if not torch.equal(actual, expected):
                problems.append(f"{what}: integer outputs differ")
            continue
        try:
            torch.testing.assert_close(actual.float(), expected.float(), atol=tol.atol, rtol=tol.rtol)
        except AssertionError as err:
            problems.append(f"{what}: {str(err).splitlines()[1:4]}")
    return [f"{spec.name}[{impl.name}] {case.name} {dtype}: {p}" for p in problems]
