"""DeepSeek-V3 in the built-in engine against transformers: multi-latent attention over the cached
latent, sigmoid routing with expert bias and group-limited top-k, the routed scaling factor, a
shared expert and a dense first layer (the tiny config has all of them), with default and YaRN
rope. Every logit the engine samples from (the prefill's and each decode step's, over the KV
cache, with slots freed and moved mid-run) equals the logits of transformers' ``generate`` with
its own cache at the same step, and the greedy continuations are the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindspeed_llm.inference import InferenceEngine, SamplingParams
from mindspeed_llm.inference.mla import mla_cache_width
from mindspeed_llm.testing.tiny_models import TINY_CONFIGS, write_tiny_tokenizer
from tests.llm.inference.conftest import random_prompts

#: YaRN as DeepSeek-V3 ships it (smaller numbers): factor, mscale, mscale_all_dim all matter.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
STEPS = 6


def _save(path: Path, rope: dict | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = TINY_CONFIGS.get("deepseek3")()
    if rope is not None:
        config.rope_parameters = dict(rope)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for layer in model.model.layers[config.first_k_dense_replace :]:
            # A bias as large as the score spread: it changes which experts are chosen.
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.3)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return model.eval()


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_prefill_and_cached_decode_logits_equal_transformers(tmp_path, rope: str) -> None:
    model = _save(tmp_path, YARN if rope == "yarn" else None)
    engine = InferenceEngine.from_pretrained(tmp_path, max_batch_size=2)
    shape = engine.model.spec.shape
    assert engine.model.spec.num_kv_heads == 1 and engine.model.spec.head_dim == mla_cache_width(shape) == 24
    prompts = random_prompts((9, 3, 14), seed=7)  # three prompts on two slots
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    advance = engine._advance

    def record(requests, logits, stream):
        for request, row in zip(requests, logits):
            seen[request.index].append(row.clone())
        advance(requests, logits, stream)

    engine._advance = record
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=STEPS, ignore_eos=True))
    assert engine.cache.keys.shape[-2:] == (1, mla_cache_width(shape) + 1)  # one latent head per token
    for index, (prompt, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            want = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=STEPS,
                min_new_tokens=STEPS,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert out.token_ids == want.sequences[0, len(prompt) :].tolist(), f"prompt {index}"
        got = torch.stack(seen[index])
        torch.testing.assert_close(got, torch.cat(want.logits).float(), atol=1e-5, rtol=0)
    # The bias and the groups decide: without them other experts would be chosen for some tokens.
    layer = engine.model.layers[1]
    hidden = torch.randn(64, shape.hidden_size, generator=torch.Generator().manual_seed(0))
    from mindspeed_llm.inference.routing import route

    chosen = route(hidden, layer.router, layer.expert_bias, shape)[1].sort(-1)[0]
    plain = torch.topk(torch.sigmoid(hidden @ layer.router.T), shape.moe_router_topk, dim=-1)[1].sort(-1)[0]
    assert not torch.equal(chosen, plain)
