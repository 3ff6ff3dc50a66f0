"""Megatron's language-model cross-entropy without tensor parallelism: one fused torch call.

``vocab_parallel_cross_entropy`` is written for logits split over tensor-parallel ranks: a max,
a subtraction, an exponent, a sum, a gather of the target logit and two all-reduces forward,
a softmax update scattered by index backward, each a separate pass over the ``[s, b, vocab]``
logits. With one tensor-parallel rank none of the reductions has a peer, and torch's
``cross_entropy`` (log-softmax and the target's negative log-likelihood, fused forward and
backward) computes the same per-token losses in fewer passes.

The same numbers: megatron's loss is ``logsumexp(x) - x[target]`` in fp32, torch's the same
through its log-softmax (float rounding apart). Targets outside the vocabulary (``-100`` of
ignored positions in fine-tuning data, which the loss mask removes) get megatron's value too:
``logsumexp(x) - max(x)``. CPU only: whether any target is out of the vocabulary is read on the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mindspeed.patching import UpstreamPatch

#: megatron-core versions the patched function was read in.
CROSS_ENTROPY_VERSIONS = ">=0.16.0,<0.17"


def _fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab).float()
    labels = target.reshape(-1)
    outside = (labels < 0) | (labels >= vocab)
    if not bool(outside.any()):  # a host read: the patch is for the CPU, where it costs nothing
        return F.cross_entropy(flat, labels, reduction="none").view(target.shape)
    # Megatron gives an out-of-vocabulary target the loss of a target logit equal to the row's
    # max, logsumexp(x) - max(x) (rows the loss mask removes; their values stay megatron's).
    loss = F.cross_entropy(flat, labels.masked_fill(outside, 0), reduction="none")
    outside_loss = torch.logsumexp(flat, dim=-1) - flat.max(dim=-1).values.detach()
    return torch.where(outside, outside_loss, loss).view(target.shape)


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
