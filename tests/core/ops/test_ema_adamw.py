"""ema_adamw and FusedEMAAdamW: equal the unfused AdamW followed by the EMA update, for every available kernel.

- Trajectories of FusedEMAAdamW (two parameter groups, a parameter skipped on some steps,
  maximize) equal torch.optim.AdamW's parameters and moments, and an EMA kept by hand after
  each of its steps.
- One step by hand on a scalar (MindSpeed's documented formula of npu_apply_fused_ema_adamw).
- The npu binding, with torch_npu replaced by the documented formula (out of place, as a
  kernel returning new tensors would), equals the reference; non-fp32 tensors and maximize too.
- ``ema_weights()`` swaps the averages in and back out.
"""

from __future__ import annotations

import types

import pytest
import torch

from mindspeed.device import get_accelerator
from mindspeed.ops.ema_adamw import FusedEMAAdamW, ema_adamw_reference
from mindspeed.ops.registry import available_kernels

SHAPES = [(7,), (3, 5), (2, 3, 4), (1,), (33, 17)]
IMPLS = [impl.name for impl in available_kernels("ema_adamw", get_accelerator().name)]
DECAY = 0.9


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [
        {"params": params[:3], "lr": 3e-2, "weight_decay": 0.1},
        {"params": params[3:], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.95), "maximize": True},
    ]


def _grads(params: list[torch.nn.Parameter], gen: torch.Generator, step: int) -> None:
    for i, param in enumerate(params):
        grad = torch.randn(param.shape, generator=gen)
        param.grad = None if (i == 3 and step % 2 == 0) else grad  # (1,) skips even steps: its own step count


@pytest.mark.parametrize("impl", IMPLS)
def test_trajectory_equals_adamw_then_ema(impl: str) -> None:
    ours, theirs = _params(), _params()
    fused = FusedEMAAdamW(_groups(ours), eps=1e-6, ema_decay=DECAY, impl=impl)
    assert fused.kernel.name == impl
    adamw = torch.optim.AdamW(_groups(theirs), eps=1e-6, foreach=False)
    emas: dict[int, torch.Tensor] = {}
    gen_ours, gen_theirs = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(6):
        _grads(ours, gen_ours, step)
        fused.step()
        _grads(theirs, gen_theirs, step)
        for i, param in enumerate(theirs):  # the EMA starts as the parameter before its first step
            if param.grad is not None and i not in emas:
                emas[i] = param.detach().clone()
        adamw.step()
        with torch.no_grad():
            for i, param in enumerate(theirs):
                if param.grad is not None:
                    emas[i].mul_(DECAY).add_(param, alpha=1 - DECAY)
    for i, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(mine, reference, atol=1e-6, rtol=1e-5)
        state = fused.state[mine]
        torch.testing.assert_close(state["ema"], emas[i], atol=1e-6, rtol=1e-5)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], adamw.state[reference][key], atol=1e-7, rtol=1e-5)
    assert int(fused.state[ours[3]]["step"]) == 3 and int(fused.state[ours[0]]["step"]) == 6
    assert not torch.equal(fused.state[ours[0]]["ema"], ours[0])

    before = [p.detach().clone() for p in ours]
    with fused.ema_weights():
        for i, param in enumerate(ours):
            assert torch.equal(param, fused.state[param]["ema"]), i
    assert all(torch.equal(p, b) for p, b in zip(ours, before))


def _documented(grad, var, m, v, s, step, lr, ema_decay, beta1, beta2, eps, mode, bias_correction, weight_decay):
    """MindSpeed's docs/ops/npu_apply_fused_ema_adamw.md, computed out of place."""
    beta1_correction = 1 - torch.pow(beta1, step) * bias_correction
    beta2_correction = 1 - torch.pow(beta2, step) * bias_correction
    grad_ = grad + weight_decay * var * (1 - mode)
    m_ = beta1 * m + (1 - beta1) * grad_
    v_ = beta2 * v + (1 - beta2) * grad_ * grad_
    update = (m_ / beta1_correction) / (torch.pow(v_ / beta2_correction, 0.5) + eps) + weight_decay * var * mode
    var_ = var - lr * update
    return var_, m_, v_, ema_decay * s + (1 - ema_decay) * var_


def test_reference_single_step_by_hand() -> None:
    values = [torch.tensor([x], dtype=torch.float64) for x in (0.5, -0.3, 0.02, 0.01, 0.45)]
    expected = _documented(
        values[1],
        values[0],
        values[2],
        values[3],
        values[4],
        torch.tensor(4.0, dtype=torch.float64),
        0.1,
        0.99,
        0.9,
        0.99,
        1e-8,
        1,
        True,
        0.05,
    )
    param, grad, m, v, ema = (t.clone() for t in values)
    ema_adamw_reference(
        [param], [grad], [m], [v], [ema], 4, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, ema_decay=0.99
    )
    for ours, theirs in zip((param, m, v, ema), expected):
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)


def test_npu_binding_equals_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from mindspeed.ops.backends import npu_basic

    calls = []

    def npu_apply_fused_ema_adamw(grad, var, m, v, s, step, *args):
        assert step.dtype == torch.int64 and step.shape == (1,) and var.dtype == torch.float32
        calls.append(int(step))
        return _documented(grad, var, m, v, s, step.double(), *args)

    fake = types.SimpleNamespace(npu_apply_fused_ema_adamw=npu_apply_fused_ema_adamw)
    monkeypatch.setattr("mindspeed.ops.backends.npu_basic.import_torch_npu", lambda: fake)
    gen = torch.Generator().manual_seed(0)
    for maximize, dtype in ((False, torch.float32), (True, torch.float32), (False, torch.float64)):
        state = [[torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES] for _ in range(5)]
        state[3] = [t.square() for t in state[3]]  # second moments are non-negative
        mine = [[t.clone() for t in ts] for ts in state]
        reference = [[t.clone() for t in ts] for ts in state]
        hyper = {
            "lr": 1e-2,
            "beta1": 0.9,
            "beta2": 0.999,
            "eps": 1e-8,
            "weight_decay": 0.1,
            "ema_decay": 0.95,
            "maximize": maximize,
        }
        npu_basic.ema_adamw_npu(mine[0], mine[1], mine[2], mine[3], mine[4], 7, **hyper)
        ema_adamw_reference(reference[0], reference[1], reference[2], reference[3], reference[4], 7, **hyper)
        for a, b in zip(mine, reference):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    assert calls == [7] * (2 * len(SHAPES))  # fp64 went through the reference


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="ema_decay"):
        FusedEMAAdamW(_params(), ema_decay=1.0)
    with pytest.raises(ValueError, match="unknown implementation"):
        FusedEMAAdamW(_params(), impl="nope")
