"""The engine's own contract: the KV-cache path equals the no-cache path token for token under
continuous batching, requests join as slots free up, stop tokens and lengths end requests, streaming,
and weight updates from Hugging Face-named tensors (whole, in buckets, and refused when wrong)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_llm.inference import InferenceEngine, SamplingParams
from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
from tests.llm.inference.conftest import random_prompts, regrown_greedy, teacher_forced_greedy

#: Five prompts of different lengths on two slots: requests wait and join as others finish.
LENGTHS = (7, 2, 11, 4, 9)


@pytest.mark.parametrize("family", ["llama2", "qwen25", "qwen3-moe"])
def test_kv_cache_generation_equals_the_no_cache_path(engine, family: str) -> None:
    eng = engine(family, max_batch_size=2)
    prompts = random_prompts(LENGTHS, seed=10)
    # Different lengths per request, so slots free up (and the last running slot moves) mid-run.
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 3, 7, 5, 6)]
    events: list[tuple[int, int]] = []
    outs = eng.generate(prompts, params, stream=lambda index, token: events.append((index, token)))
    assert eng.cache.num_slots == 2
    for index, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.prompt_token_ids == prompt and out.finish_reason == "length"
        assert out.token_ids == teacher_forced_greedy(eng, prompt, out.token_ids), f"request {index}"
        if index == 0:  # once, literally: the forward re-run on the growing sequence
            assert out.token_ids == regrown_greedy(eng, prompt, len(out.token_ids))
        assert [t for i, t in events if i == index] == out.token_ids  # streamed in order
    order = [i for i, _ in events]
    # Request 2 waited for a slot and started once request 1 (3 tokens) finished, while 0 still ran.
    assert order.index(2) > len(order) - 1 - order[::-1].index(1)
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)


def test_stop_tokens_and_length_limits(engine) -> None:
    eng = engine("qwen3", max_batch_size=3)
    assert eng.eos_token_ids == (2,)  # from generation_config.json
    prompts = random_prompts((5, 8), seed=11)
    free = eng.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    stop = free[0].token_ids[3]
    first = free[0].token_ids.index(stop)
    eng.free_cache()  # the next call allocates a fresh one
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=10, stop_token_ids=(stop,), ignore_eos=True))
    assert outs[0].token_ids == free[0].token_ids[: first + 1] and outs[0].finish_reason == "stop"
    other = free[1].token_ids
    cut = other.index(stop) + 1 if stop in other else len(other)
    assert outs[1].token_ids == other[:cut]
    assert outs[1].finish_reason == ("stop" if stop in other else "length")


def test_max_seq_len_caps_generation_and_rejects_long_prompts(tiny_checkpoints) -> None:
    eng = InferenceEngine.from_pretrained(tiny_checkpoints["mistral"], max_batch_size=2, max_seq_len=12)
    prompts = random_prompts((8, 3), seed=12)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 9] and {o.finish_reason for o in outs} == {"length"}
    assert outs[0].token_ids == teacher_forced_greedy(eng, prompts[0], outs[0].token_ids)
    with pytest.raises(ValueError, match="prompt 1 has 12 tokens.*max_seq_len=12"):
        eng.generate([[5], [5] * 12])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([[5, 500]])


def test_load_weights_switches_to_the_new_model(tiny_checkpoints, tmp_path) -> None:
    eng = InferenceEngine.from_pretrained(tiny_checkpoints["qwen3-moe"])
    new_model = save_tiny_checkpoint("qwen3-moe", tmp_path / "new", seed=7)
    state = {}
    for file in sorted((tmp_path / "new").glob("*.safetensors")):
        state.update(load_file(file))
    (tokens,) = random_prompts((9,), seed=13)
    with torch.no_grad():
        want = new_model(torch.tensor([tokens])).logits[0]
    before = eng.forward_logits(tokens)
    assert (before - want).abs().max() > 0.1
    # Two buckets that split fused weights: q_proj and gate_proj first, their partners later.
    first = {k: v for k, v in state.items() if "q_proj" in k or "gate_proj" in k or "embed" in k}
    eng.load_weights(first)
    eng.load_weights({k: v for k, v in state.items() if k not in first})
    torch.testing.assert_close(eng.forward_logits(tokens), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "deepseek3"])
def test_from_config_then_load_weights_is_the_checkpoint(engine, hf_model, tiny_checkpoints, family: str) -> None:
    """A rollout engine built from a config alone, weights pushed in: the same model as loading the files."""
    model = hf_model(family)
    fresh = InferenceEngine.from_config(model.config, max_batch_size=2)
    assert fresh.eos_token_ids == (model.config.eos_token_id,)
    state = {}
    for file in sorted(tiny_checkpoints[family].glob("*.safetensors")):
        state.update(load_file(file))
    fresh.load_weights(state)
    prompts = random_prompts((4, 8, 6), seed=14)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in fresh.generate(prompts, params)] == [
        o.token_ids for o in engine(family).generate(prompts, params)
    ]
    torch.testing.assert_close(
        fresh.forward_logits(prompts[1]), engine(family).forward_logits(prompts[1]), atol=0, rtol=0
    )


def test_load_weights_refuses_unknown_names_and_shapes(engine) -> None:
    eng = engine("llama2")
    before = eng.forward_logits([3, 4, 5])
    with pytest.raises(ValueError, match="has no tensors named model.layers.9.mlp.up_proj.weight"):
        eng.load_weights({"model.norm.weight": torch.zeros(64), "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model.norm.weight\) has shape \(3,\), the model expects \(64,\)"):
        eng.load_weights({"model.norm.weight": torch.zeros(3)})
    torch.testing.assert_close(eng.forward_logits([3, 4, 5]), before, atol=0, rtol=0)
