"""The fused log-prob head (``packed_logp_entropy``) against the general head
(``vocab_parallel_logp_entropy`` on the gathered rows) and ``log_softmax`` in float64: log-probs,
entropies and the logits' gradient, with a position read by several responses (a shared prompt's
last token), masked tokens and positions no response reads."""

from __future__ import annotations

import pytest
import torch


def _case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    positions, vocab = 23, 97
    logits = (torch.randn(1, positions, vocab, generator=gen) * 4).to(dtype)
    # 3 responses of width 6: all three read position 4 first (the shared prompt's last token);
    # positions 0-3 are read by none; the last response is 4 tokens long (2 masked).
    index = torch.tensor([[4, 5, 6, 7, 8, 9], [4, 10, 11, 12, 13, 14], [4, 15, 16, 17, 0, 0]])
    targets = torch.randint(0, vocab, index.shape, generator=gen)
    targets[2, 4:] = -1  # masked: any value
    mask = torch.ones(index.shape)
    mask[2, 4:] = 0
    weights = torch.randn(index.shape, generator=gen)
    return logits, index, targets, mask, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_equals_general_head_and_log_softmax(dtype: torch.dtype) -> None:
    from mindspeed_rl.models.actor_parallel import vocab_parallel_logp_entropy
    from mindspeed_rl.models.logp_head import packed_logp_entropy

    logits, index, targets, mask, weights = _case(dtype)
    vocab = logits.shape[-1]

    fused_x = logits.clone().requires_grad_()
    logp, entropy = packed_logp_entropy(fused_x, index, targets)
    assert not entropy.requires_grad, "the fused head's entropy has no gradient"
    (weights * logp * mask).sum().backward()

    general_x = logits.clone().requires_grad_()
    rows = general_x.reshape(-1, vocab)[index]
    g_logp, g_entropy = vocab_parallel_logp_entropy(rows, targets, 0, vocab)
    (weights * g_logp * mask).sum().backward()

    ref_x = logits.double().requires_grad_()
    logp_all = torch.log_softmax(ref_x.reshape(-1, vocab), -1)
    ref_logp = logp_all[index, targets.clamp(min=0)]
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)[index]
    (weights.double() * ref_logp * mask.double()).sum().backward()

    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for name, value, ref in (
        ("logp", logp * mask, ref_logp * mask),
        ("entropy", entropy * mask, ref_entropy * mask),
        ("grad", fused_x.grad, ref_x.grad),
    ):
        torch.testing.assert_close(value.double(), ref.detach(), **tol, msg=f"{name} vs log_softmax")
    assert logp.dtype == torch.float32 and fused_x.grad.dtype == dtype
    # Against the general head, in the same precision: the same numbers to fp32 rounding.
    torch.testing.assert_close(logp * mask, g_logp * mask, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy * mask, g_entropy * mask, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_x.grad.float(), general_x.grad.float(), rtol=1e-6, atol=1e-6)
    # Position 4 is read by three responses: its gradient is the sum of theirs.
    assert fused_x.grad[0, :4].abs().max() == 0, "positions no response reads got a gradient"
    assert fused_x.grad[0, 4].abs().sum() > 0


def test_fused_head_without_entropy() -> None:
    from mindspeed_rl.models.logp_head import packed_logp_entropy

    logits, index, targets, _, _ = _case(torch.float32)
    logp, entropy = packed_logp_entropy(logits, index, targets, entropy=False)
    assert entropy is None
    torch.testing.assert_close(logp, packed_logp_entropy(logits, index, targets)[0], rtol=0, atol=0)
