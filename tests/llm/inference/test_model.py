"""The decoder against transformers: logits (every family: tied, MoE, llama3 rope, QK norm, q/k/v bias,
a sliding window), log-probabilities of ``score``, greedy generation, and the unsupported-family error."""

from __future__ import annotations

import json

import pytest
import torch

from mindspeed_llm.inference import SUPPORTED_FAMILIES, InferenceEngine
from mindspeed_llm.testing.tiny_models import TINY_CONFIGS
from tests.llm.inference.conftest import FAMILIES, random_prompts


def test_every_supported_family_is_tested() -> None:
    assert sorted(FAMILIES) == sorted(SUPPORTED_FAMILIES)
    assert set(FAMILIES) <= set(TINY_CONFIGS), "every family that declares infers needs a tiny config"


def test_a_family_without_infers_is_refused(monkeypatch, tiny_checkpoints) -> None:
    """Every bridged family runs in the decoder today; one whose bridge stops declaring ``infers``
    is refused with what it is made of and the list of supported families."""
    from mindspeed_llm.bridges.base import Capabilities
    from mindspeed_llm.bridges.families.qwen2_moe import Qwen2MoeBridge

    monkeypatch.setattr(Qwen2MoeBridge, "capabilities", Capabilities(infers=False, moe=True, shared_experts=True))
    with pytest.raises(ValueError, match=r"the qwen2-moe family \(.*shared.*\) is not supported by the built-in "):
        InferenceEngine.from_pretrained(tiny_checkpoints["qwen2-moe"])


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(engine, hf_model, family: str) -> None:
    (tokens,) = random_prompts((13,), seed=1)
    with torch.no_grad():
        want = hf_model(family)(torch.tensor([tokens])).logits[0].float()
    got = engine(family).forward_logits(tokens)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_sliding_window_logits_and_cached_generation_equal_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    config = TINY_CONFIGS.get("mistral")()
    config.sliding_window = 4  # shorter than the prompts: the window really cuts
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(tmp_path)
    engine = InferenceEngine.from_pretrained(tmp_path, max_batch_size=2)
    prompts = random_prompts((9, 3, 6), seed=2)  # three prompts on two slots
    with torch.no_grad():
        want = model(torch.tensor([prompts[0]])).logits[0]
        reference = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    torch.testing.assert_close(engine.forward_logits(prompts[0]), want, atol=1e-5, rtol=0)
    outs = engine.generate(prompts, _greedy(8))
    assert [o.token_ids for o in outs] == reference


def _greedy(n: int):
    from mindspeed_llm.inference import SamplingParams

    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize(
    "family", ["llama2", "qwen3-moe", "qwen2-moe", "deepseek3", "gemma3", "glm45-moe", "gpt-oss", "qwen3-next"]
)
def test_greedy_equals_transformers_generate(engine, hf_model, family: str) -> None:
    prompts = random_prompts((5, 11, 2), seed=3)
    model = hf_model(family)
    with torch.no_grad():
        want = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    outs = engine(family, max_batch_size=2).generate(prompts, _greedy(8))
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_score_equals_log_softmax_of_transformers(engine, hf_model, family: str) -> None:
    sequences = random_prompts((7, 1, 12, 4, 9), seed=4)
    got = engine(family, max_batch_size=2).score(sequences)
    model = hf_model(family)
    for tokens, scores in zip(sequences, got):
        with torch.no_grad():
            logprobs = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        want = logprobs[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:], dtype=torch.long)]
        assert scores.dtype == torch.float32 and scores.shape == (len(tokens) - 1,)
        torch.testing.assert_close(scores, want, atol=1e-5, rtol=0)


def test_generation_logprobs_are_the_models_log_softmax(engine) -> None:
    from mindspeed_llm.inference import SamplingParams

    eng = engine("qwen3")
    (prompt,) = random_prompts((6,), seed=5)
    # Sampled with a temperature and filters: the logprobs are still those of the raw model.
    (out,) = eng.generate(
        [prompt], SamplingParams(max_new_tokens=6, temperature=1.7, top_k=20, top_p=0.8, seed=1, ignore_eos=True)
    )
    logits = eng.forward_logits(prompt + out.token_ids)[len(prompt) - 1 : -1].log_softmax(-1)
    want = logits[torch.arange(6), torch.tensor(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-5, rtol=0)


def test_bfloat16_runs_close_to_fp32(engine, tiny_checkpoints) -> None:
    """bf16 logits are as far from fp32 as transformers' own bf16 run is (0.011 and 0.013 as measured)."""
    from transformers import AutoModelForCausalLM

    (tokens,) = random_prompts((10,), seed=6)
    half = InferenceEngine.from_pretrained(tiny_checkpoints["llama2"], dtype="bfloat16")
    assert half.model.dtype == torch.bfloat16
    full = engine("llama2").forward_logits(tokens)
    error = float((half.forward_logits(tokens).float() - full).abs().max())
    hf = {
        dtype: AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama2"], dtype=dtype).eval()
        for dtype in (torch.bfloat16, torch.float32)
    }
    with torch.no_grad():
        hf_logits = {dtype: model(torch.tensor([tokens])).logits[0].float() for dtype, model in hf.items()}
    hf_error = float((hf_logits[torch.bfloat16] - hf_logits[torch.float32]).abs().max())
    assert 1e-4 < error < 0.03, error  # really bf16, and close
    assert error < 1.5 * hf_error, (error, hf_error)


def test_unknown_architecture_names_the_supported_ones(tiny_checkpoints, tmp_path) -> None:
    import shutil

    shutil.copytree(tiny_checkpoints["llama2"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture FalconForCausalLM; supported: .*LlamaForCausalLM"):
        InferenceEngine.from_pretrained(tmp_path / "m")
