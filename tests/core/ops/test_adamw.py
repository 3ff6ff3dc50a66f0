"""adamw and FusedAdamW: trajectories equal torch.optim.AdamW's for every available kernel."""

from __future__ import annotations

import copy

import pytest
import torch

from mindspeed.device import get_accelerator
from mindspeed.ops.adamw import FusedAdamW, adamw_reference
from mindspeed.ops.registry import available_kernels

SHAPES = [(7,), (3, 5), (2, 3, 4), (1,), (33, 17)]
IMPLS = [impl.name for impl in available_kernels("adamw", get_accelerator().name)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    # Two groups with their own hyperparameters; the second ascends (maximize) without decay.
    return [
        {"params": params[:3], "lr": 3e-2, "weight_decay": 0.1},
        {"params": params[3:], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.95), "maximize": True},
    ]


def _run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    gen = torch.Generator().manual_seed(123)
    for step in range(steps):
        for i, param in enumerate(params):
            grad = torch.randn(param.shape, generator=gen)
            # The (1,) parameter gets no gradient on even steps: it keeps its own step count.
            param.grad = None if (i == 3 and step % 2 == 0) else grad
        optimizer.step()


@pytest.mark.parametrize("impl", IMPLS)
def test_trajectory_matches_torch_adamw(impl: str) -> None:
    ours, theirs = _params(), _params()
    fused = FusedAdamW(_groups(ours), eps=1e-6, impl=impl)
    assert fused.kernel.name == impl
    torch_adamw = torch.optim.AdamW(_groups(theirs), eps=1e-6, foreach=False)
    _run(fused, ours, steps=6)
    _run(torch_adamw, theirs, steps=6)
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference, atol=1e-6, rtol=1e-5)
        mine_state, reference_state = fused.state[mine], torch_adamw.state[reference]
        assert int(mine_state["step"]) == int(reference_state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine_state[key], reference_state[key], atol=1e-7, rtol=1e-5)
    assert int(fused.state[ours[3]]["step"]) == 3 and int(fused.state[ours[0]]["step"]) == 6


def test_auto_picks_the_best_available_kernel() -> None:
    assert FusedAdamW(_params(), impl="auto").kernel.name == IMPLS[0]


def test_state_dict_round_trips_with_torch_adamw() -> None:
    ours, theirs = _params(), _params()
    fused = FusedAdamW(_groups(ours))
    _run(fused, ours, steps=3)
    # Continue our run in torch's AdamW and theirs in ours: both must agree afterwards.
    torch_adamw = torch.optim.AdamW(_groups(theirs), foreach=False)
    with torch.no_grad():
        for mine, other in zip(ours, theirs, strict=True):
            other.copy_(mine)
    # Deep copies: a state_dict holds references to the live moment tensors.
    torch_adamw.load_state_dict(copy.deepcopy(fused.state_dict()))
    resumed = FusedAdamW(_groups(ours))
    resumed.load_state_dict(copy.deepcopy(torch_adamw.state_dict()))
    _run(torch_adamw, theirs, steps=2)
    _run(resumed, ours, steps=2)
    for mine, other in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, other, atol=1e-6, rtol=1e-5)


def test_reference_single_step_by_hand() -> None:
    # One step on one scalar, written out from the AdamW paper's algorithm (decoupled decay).
    p, g, lr, b1, b2, eps, wd, step = 0.5, -0.3, 0.1, 0.9, 0.99, 1e-8, 0.05, 4
    m0, v0 = 0.02, 0.01
    m = b1 * m0 + (1 - b1) * g
    v = b2 * v0 + (1 - b2) * g * g
    expected = p * (1 - lr * wd) - lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)) ** 0.5 + eps)
    tensors = [torch.tensor([x], dtype=torch.float64) for x in (p, g, m0, v0)]
    adamw_reference(*([t] for t in tensors), step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    assert tensors[0].item() == pytest.approx(expected, rel=1e-12)
    assert tensors[2].item() == pytest.approx(m, rel=1e-12) and tensors[3].item() == pytest.approx(v, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"impl": "nope"}, "unknown implementation"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FusedAdamW(_params(), **kwargs)
