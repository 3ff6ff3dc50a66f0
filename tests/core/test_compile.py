"""``mindspeed.compile`` and the registry kernels inside a compiled region (dynamo only, no Inductor: fast).

- the CPU kernels a megatron layer runs (``rms_norm``, ``swiglu``, ``rotary_pos_emb``: ``native``;
  ``attention``: ``sdpa``) trace into one graph under ``fullgraph=True`` (a graph break raises),
  forward and backward equal to the eager kernels', the untraceable ones through their reference;
- :class:`CompileWatch` counts this block's graphs only, and a second call compiles nothing;
- :func:`compile_forwards` keeps the parameter names; unknown modes are refused.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed.compile import CompileWatch, compile_forwards, compile_mode
from mindspeed.ops import resolve_kernel

KERNELS = (
    resolve_kernel("rms_norm", "native"),
    resolve_kernel("swiglu", "native"),
    resolve_kernel("rotary_pos_emb", "native"),
    resolve_kernel("attention", "sdpa"),
)


def _layer_ops(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    norm, swiglu, rotary, attention = KERNELS  # resolved at build time, as the layer spec does
    h = norm(x, weight)  # [b, s, 4 * d]
    q = rotary(h[..., :8].reshape(2, 1, 6, 8), cos, sin)  # [b, n, s, d]
    out = attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), causal=True)
    return swiglu(h).sum() + out.sum()


def test_registry_kernels_trace_into_one_graph() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32, requires_grad=True)
    weight = torch.rand(32)
    angles = torch.randn(6, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    watch = CompileWatch()
    compiled = torch.compile(_layer_ops, backend="eager", fullgraph=True, dynamic=False)
    loss = compiled(x, weight, cos, sin)
    (grad,) = torch.autograd.grad(loss, x)
    compiled(x, weight, cos, sin)
    assert watch.graphs() == 1  # one graph, and the second call compiled nothing
    eager = _layer_ops(x, weight, cos, sin)
    (eager_grad,) = torch.autograd.grad(eager, x)
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-6, atol=1e-6)


def test_compile_forwards_keeps_names_and_modes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    names = list(model.state_dict())
    assert compile_forwards(model.named_children(), "default") == ["0", "1"]
    assert list(model.state_dict()) == names
    assert compile_mode(False) is None and compile_mode(True) == "default"
    assert compile_mode("max-autotune") == "max-autotune"
    with pytest.raises(ValueError, match="train.compile='fast': use true, false or default, max-autotune"):
        compile_mode("fast")
