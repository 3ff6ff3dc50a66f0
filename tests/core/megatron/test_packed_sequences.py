"""Packed (THD) sequences through a megatron-core GPTModel on the registry attention: each
sequence of a pack gets the logits and the gradients it gets alone (no attention across the
boundary, rope positions restart), with the registry kernel and the reference alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

LENGTHS = (5, 9, 2)


def _forward(gpt: Any, tokens: torch.Tensor, packed: Any = None) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    return gpt(tokens, positions, None, packed_seq_params=packed)


def _check(rank: int, world_size: int, impl: str) -> dict[str, Any]:
    from megatron.core.packed_seq_params import PackedSeqParams

    from mindspeed.megatron import adapt, unadapt
    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.testing.megatron import (
        ParallelSizes,
        TinyGPTConfig,
        build_gpt,
        destroy_parallel,
        init_parallel,
        unwrap,
    )

    model, sizes = TinyGPTConfig(num_layers=2), ParallelSizes()
    adapt()
    init_parallel(sizes)
    try:
        spec = get_gpt_layer_spec(impls={"attention": impl, "rms_norm": impl})
        (chunk,) = build_gpt(model, sizes, layer_spec=spec, use_te_activation_func=True)
        gpt = unwrap(chunk)
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, model.vocab_size, (1, n), generator=gen) for n in LENGTHS]
        # Alone: one forward per sequence; the gradient of the summed logits of all of them.
        alone = [_forward(gpt, s) for s in seqs]
        sum(out.sum() for out in alone).backward()
        grads_alone = {
            n: p.main_grad.clone() if hasattr(p, "main_grad") else p.grad.clone() for n, p in gpt.named_parameters()
        }
        for p in gpt.parameters():
            p.grad = None
        chunk.zero_grad_buffer()
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        packed = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS)
        )
        together = _forward(gpt, torch.cat(seqs, dim=1), packed)
        together.sum().backward()
        grads_packed = {
            n: p.main_grad.clone() if hasattr(p, "main_grad") else p.grad.clone() for n, p in gpt.named_parameters()
        }
        # Without the packing information the later sequences see the earlier ones.
        plain = _forward(gpt, torch.cat(seqs, dim=1))
        pieces = together.split(list(LENGTHS), dim=1)
        return {
            "logits": max(float((a - b).abs().max()) for a, b in zip(alone, pieces)),
            # Relative: the gradients of summed logits reach the hundreds.
            "grads": max(
                float((grads_alone[n] - grads_packed[n]).abs().max() / grads_alone[n].abs().max().clamp_min(1))
                for n in grads_alone
            ),
            "grad_names": len(grads_alone),
            "unpacked_differs": float((plain - together).abs().max()),
        }
    finally:
        destroy_parallel()
        unadapt()


@pytest.mark.distributed
@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_packed_sequences_equal_separate_ones(impl: str) -> None:
    (out,) = run_distributed(_check, 1, impl)
    assert out["logits"] < 1e-5, out
    assert out["grads"] < 1e-5, out
    assert out["grad_names"] > 10
    assert out["unpacked_differs"] > 1e-2, "the packing information made no difference: the test proves nothing"
