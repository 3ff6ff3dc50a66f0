"""Sampling: filters equal transformers' warpers, draws follow the filtered distribution, and a
request's tokens depend only on its own prompt, settings and seed (not on the batch around it)."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_llm.inference import SamplingParams
from mindspeed_llm.inference.sampling import Sampler, exponential_noise, filter_logits, request_key
from tests.llm.inference.conftest import random_prompts


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 12, 0.85), (2.0, 1, 0.3)]
)
def test_filters_equal_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    rows = logits.shape[0]
    got = filter_logits(
        logits, torch.full((rows,), temperature), torch.full((rows,), top_k), torch.full((rows,), top_p)
    )
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_rows_keep_their_own_settings() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    got = filter_logits(logits, torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0, 4, 0]), torch.tensor([1.0, 1.0, 0.5]))
    for row, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.5, 4, 1.0), (1.0, 0, 0.5)]):
        alone = filter_logits(logits[row : row + 1], torch.tensor([t]), torch.tensor([k]), torch.tensor([p]))
        assert torch.equal(got[row : row + 1], alone)


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(400, 6)
    sampler = Sampler(torch.device("cpu"))
    params = [SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=seed) for seed in range(400)]
    generators = [sampler.generator(p) for p in params]
    draws = [token for step in range(10) for token in sampler.sample(logits, params, generators, [step] * 400)[0]]
    counts = torch.bincount(torch.tensor(draws), minlength=6).float() / len(draws)
    want = filter_logits(logits[:1], torch.tensor([0.8]), torch.tensor([4]), torch.tensor([0.9])).softmax(-1)[0]
    assert counts[want == 0].sum() == 0  # filtered tokens never come out
    torch.testing.assert_close(counts, want, atol=0.04, rtol=0)  # ~4 standard errors at 4000 draws


def test_batched_noise_equals_one_call_per_request() -> None:
    # The counter-based noise of a batch is, bit for bit, what each request gets alone; draws
    # from one batched call equal the per-request path (one call per row) token for token.
    keys = torch.tensor([request_key(s) for s in (0, 1, 2**40 + 1, 2**62 - 1, 7, 7)], dtype=torch.int64)
    steps = torch.tensor([0, 3, 5, 0, 1, 2], dtype=torch.int64)
    batched = exponential_noise(keys, steps, 300)
    for row in range(len(keys)):
        assert torch.equal(batched[row : row + 1], exponential_noise(keys[row : row + 1], steps[row : row + 1], 300))
    assert not torch.equal(batched[4], batched[5])  # same key, another step: other noise
    assert len({request_key(s) for s in range(1000)}) == 1000
    # Exp(1): mean 1 and P(E > 1) = 1/e over 1.8 M draws (standard errors ~1e-3 and ~4e-4).
    many = exponential_noise(torch.tensor([request_key(s) for s in range(60)]), torch.arange(60), 30_000)
    assert abs(float(many.mean()) - 1.0) < 5e-3
    assert abs(float((many > 1).double().mean()) - math.exp(-1)) < 2e-3
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 2
    sampler = Sampler(torch.device("cpu"))
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=s)
        for t, k, p, s in [
            (1.0, 0, 1.0, 1),
            (0.7, 20, 1.0, 2),
            (1.3, 0, 0.8, 3),
            (0.0, 0, 1.0, None),
            (1.0, 0, 1.0, 5),
            (1.0, 0, 1.0, 5),
        ]
    ]
    generators = [sampler.generator(p) for p in params]
    tokens, logprobs = sampler.sample(logits, params, generators, [0, 1, 2, 3, 4, 9])
    for row, step in enumerate([0, 1, 2, 3, 4, 9]):
        alone = sampler.sample(logits[row : row + 1], [params[row]], [generators[row]], [step])
        assert alone == ([tokens[row]], [logprobs[row]])


def test_top_k_one_is_greedy(engine) -> None:
    eng = engine("llama2", max_batch_size=2)
    prompts = random_prompts((4, 7, 3), seed=20)
    greedy = eng.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    top1 = eng.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, seed=5, ignore_eos=True))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_same_seed_same_tokens_whatever_the_batch(engine) -> None:
    prompts = random_prompts((5, 9, 3, 6), seed=21)
    params = SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine("mixtral", max_batch_size=1).generate([prompts[1]], params)[0].token_ids
    batched = engine("mixtral", max_batch_size=3).generate(prompts, params)
    assert batched[1].token_ids == alone
    reordered = engine("mixtral", max_batch_size=3).generate([prompts[3], prompts[1], prompts[0]], params)
    assert reordered[1].token_ids == alone
    # Another seed gives another draw; seed=None draws from torch's global generator.
    other = (
        engine("mixtral", max_batch_size=3)
        .generate(
            [prompts[1]], SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.95, seed=99, ignore_eos=True)
        )[0]
        .token_ids
    )
    assert other != alone
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(
            engine("mixtral").generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=1.5, ignore_eos=True))
        )
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert runs[0][0].token_ids != runs[0][1].token_ids or prompts[0] != prompts[1]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_new_tokens", 0, "max_new_tokens must be at least 1"),
        ("temperature", -1.0, "temperature must be >= 0"),
        ("top_k", -2, "top_k must be >= 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_settings_are_refused(field: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
