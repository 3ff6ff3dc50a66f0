"""``vocab_parallel_logp_entropy`` on one rank: log-probs, entropy and their gradients against
``log_softmax``, with and without padding columns (the unpadded path skips the masks)."""

from __future__ import annotations

import torch


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.double(), dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], entropy


def test_logp_entropy_equal_log_softmax_with_and_without_padding_columns() -> None:
    from mindspeed_rl.models.actor_parallel import vocab_parallel_logp_entropy

    gen = torch.Generator().manual_seed(0)
    vocab, pad = 50, 3
    logits = torch.randn(7, vocab + pad, generator=gen) * 3
    logits[:, vocab:] = 40.0  # padding columns far above the rest: left in, they would dominate
    targets = torch.randint(0, vocab, (7,), generator=gen)
    weights = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    results = {}
    for name, columns in (("unpadded", vocab), ("padded", vocab + pad)):
        x = logits[:, :columns].clone().requires_grad_()
        logp, entropy = vocab_parallel_logp_entropy(x, targets, 0, vocab)
        (weights[0] * logp + weights[1] * entropy).sum().backward()
        results[name] = (logp.detach(), entropy.detach(), x.grad[:, :vocab])
        if columns > vocab:
            assert torch.equal(x.grad[:, vocab:], torch.zeros(7, pad)), "padding columns got a gradient"
    ref_x = logits[:, :vocab].double().requires_grad_()
    ref_logp, ref_entropy = _reference(ref_x, targets)
    (weights[0] * ref_logp + weights[1] * ref_entropy).sum().backward()
    for name, (logp, entropy, grad) in results.items():
        torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=1e-5, atol=1e-5, msg=f"{name} logp")
        torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=1e-5, atol=1e-5, msg=f"{name} entropy")
        torch.testing.assert_close(grad.double(), ref_x.grad, rtol=1e-5, atol=1e-5, msg=f"{name} grad")
