"""Activation swap of arbitrary modules (the MM trainer's ``train.swap_modules``): same gradients, tensors copied out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mindspeed.memory.swap_attention import SwapAttention


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)))


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(x).square().mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_swapped_modules_give_the_same_gradients_and_copy_their_saved_tensors() -> None:
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    plain = _grads(_model(), x)
    model = _model()
    swap = SwapAttention(min_bytes=1024).install_modules(list(model))
    for _ in range(2):  # the second forward starts a new round of prefetches
        got = _grads(model, x)
        assert all(torch.equal(got[name], grad) for name, grad in plain.items())
    # Per block and forward at least the GELU's input and the second linear's input (128 x 256 x 4 B each).
    assert swap.swapped_bytes >= 2 * 3 * 2 * 128 * 256 * 4
    swap.remove()
    assert torch.equal(_grads(model, x)["0.0.weight"], plain["0.0.weight"])


def test_the_trainer_refuses_a_module_both_recomputed_and_swapped() -> None:
    from mindspeed_mm.trainer.fsdp import apply_recompute, apply_swap

    model = _model()
    recomputed = apply_recompute(model, ["0"])
    with pytest.raises(ValueError, match="recompute a module or swap it, not both"):
        apply_swap(model, ["0.*"], recomputed)
    with pytest.raises(ValueError, match="train.swap_modules: pattern 'nothing' matches no module"):
        apply_swap(model, ["nothing"], recomputed)
    assert apply_swap(model, ["1", "2"], recomputed) is not None
