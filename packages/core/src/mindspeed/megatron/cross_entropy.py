"""Megatron's language-model cross-entropy without tensor parallelism: two passes each way.

``vocab_parallel_cross_entropy`` is written for logits split over tensor-parallel ranks: a max,
a subtraction, an exponent, a sum, a gather of the target logit and two all-reduces forward,
a softmax update scattered by index backward, each a separate pass over the ``[s, b, vocab]``
logits. With one tensor-parallel rank none of the reductions has a peer: a fused log-softmax
and a gather give the same per-token losses, and the backward turns the kept log-softmax into
the gradient in place (:class:`_TokenCrossEntropy`; torch's ``cross_entropy`` with
``reduction="none"`` also zero-fills a one-hot gradient and makes a reduction pass: 6-8 against
5.3 ms CPU for 1,024 tokens x 1,792 vocabulary, forward and backward, one thread).

The same numbers: megatron's loss is ``logsumexp(x) - x[target]`` in fp32, ours the same
through the log-softmax (float rounding apart). Targets outside the vocabulary (``-100`` of
ignored positions in fine-tuning data, which the loss mask removes) get megatron's value too:
``logsumexp(x) - max(x)``. CPU only: whether any target is out of the vocabulary is read on the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from mindspeed.patching import UpstreamPatch

#: megatron-core versions the patched function was read in.
CROSS_ENTROPY_VERSIONS = ">=0.16.0,<0.17"


class _TokenCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``[tokens, vocab]`` fp32 logits, two passes each way.

    Forward: one fused ``log_softmax`` (kept for the backward, as torch's loss keeps it) and a
    gather of the targets. Backward: the softmax recovered in place from that buffer
    (``exp_``), scaled by the per-token gradient (``mul_``), the target entries lowered by it:
    no zero-filled ``[tokens, vocab]`` one-hot gradient and no separate reduction pass, as
    ``nll_loss``'s and ``log_softmax``'s backwards make. The buffer becomes the gradient, so the
    function backs up once (a second backward through the same graph raises).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: D102
        logp = torch.log_softmax(logits, dim=-1)
        outside = (target < 0) | (target >= logits.shape[-1])
        if bool(outside.any()):  # a host read: the patch is for the CPU, where it costs nothing
            # Megatron gives an out-of-vocabulary target the loss of a target logit equal to the
            # row's max, logsumexp(x) - max(x) = -max(log p), and no target term in the gradient.
            index = target.masked_fill(outside, 0)
            picked = logp.gather(1, index.unsqueeze(1)).squeeze(1)
            loss = torch.where(outside, logp.amax(dim=-1), picked).neg_()
            ctx.inside = ~outside
        else:
            index = target
            loss = logp.gather(1, index.unsqueeze(1)).squeeze(1).neg_()
            ctx.inside = None
        ctx.logp, ctx.index = logp, index
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        if ctx.logp is None:
            raise RuntimeError("the fused cross-entropy's backward ran twice; it frees its buffer after the first")
        grad, ctx.logp = ctx.logp, None
        grad.exp_().mul_(grad_loss.unsqueeze(1))
        lowered = grad_loss if ctx.inside is None else grad_loss * ctx.inside
        grad.scatter_add_(1, ctx.index.unsqueeze(1), lowered.neg().unsqueeze(1))
        return grad, None


def _fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab).float()
    return _TokenCrossEntropy.apply(flat, target.reshape(-1)).view(target.shape)


def _cross_entropy(original: Any, acc: Any) -> Any:
    from megatron.core.parallel_state import get_tensor_model_parallel_world_size

    def vocab_parallel_cross_entropy(
        vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        if label_smoothing != 0.0 or get_tensor_model_parallel_world_size() != 1:
            return original(vocab_parallel_logits, target, label_smoothing)
        return _fused_cross_entropy(vocab_parallel_logits, target)

    return vocab_parallel_cross_entropy


def cross_entropy_patches() -> list[UpstreamPatch]:
    """The fused cross-entropy where megatron's language models look it up (tensor-parallel size 1)."""
    return [
        UpstreamPatch(
            "fused-cross-entropy-tp1",
            "megatron.core.tensor_parallel.vocab_parallel_cross_entropy",
            _cross_entropy,
            distribution="megatron-core",
            versions=CROSS_ENTROPY_VERSIONS,
            reason="the vocab-parallel cross-entropy makes ~10 passes over the logits; with one "
            "tensor-parallel rank torch's fused cross_entropy gives the same losses",
            # It reads on the host whether a target is out of the vocabulary: free on the CPU only.
            accelerators=("cpu",),
        )
    ]
