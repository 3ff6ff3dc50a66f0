"""The registry kernels compose into a Llama whose logits equal transformers' LlamaForCausalLM."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mindspeed.testing.models import TINY_CONFIGS, hf_llama_kwargs
from mindspeed.testing.tiny_llama import TinyLlama


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-tiny-mha", "llama-tiny-mqa-tied"])
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_logits_and_grads_equal_hf(preset: str, impl: str) -> None:
    cfg = TINY_CONFIGS.get(preset)
    torch.manual_seed(0)
    ours = TinyLlama(cfg, impl=impl)
    hf = LlamaForCausalLM(LlamaConfig(**hf_llama_kwargs(cfg), attn_implementation="eager"))
    hf.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(cfg.vocab_size, (2, 37))
    ours_logits = ours(ids)
    hf_logits = hf(input_ids=ids).logits
    torch.testing.assert_close(ours_logits, hf_logits, atol=2e-5, rtol=2e-5)
    ours_logits.square().mean().backward()
    hf_logits.square().mean().backward()
    hf_grads = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_sliding_window_matches_full_attention_when_window_covers_sequence() -> None:
    cfg = TINY_CONFIGS.get("llama-tiny")
    torch.manual_seed(0)
    full = TinyLlama(cfg, impl="reference")
    wide = TinyLlama(cfg, impl="reference", sliding_window=64)
    narrow = TinyLlama(cfg, impl="reference", sliding_window=4)
    wide.load_state_dict(full.state_dict())
    narrow.load_state_dict(full.state_dict())
    ids = torch.randint(cfg.vocab_size, (1, 32))
    torch.testing.assert_close(wide(ids), full(ids))
    # A 4-token window changes every position from the 5th on, and none before it.
    diff = (narrow(ids) - full(ids)).abs().amax(dim=-1)[0]
    assert torch.all(diff[:4] < 1e-6) and torch.all(diff[4:] > 1e-6)
