"""Prefix sharing: requests admitted together with the same prompt (an RL group) prefill it once,
and their tokens and log-probs are those of the unshared path (each prompt prefilled per request)."""

from __future__ import annotations

import pytest

from mindspeed_llm.inference import SamplingParams
from tests.llm.inference.conftest import random_prompts


def _run(eng, prompts, params, sharing: bool) -> tuple[list, list[int]]:
    """Outputs and the prefilled rows of each forward (decode forwards have one token per row)."""
    hidden, rows = eng.model.hidden, []

    def counting(tokens, positions, step):
        rows.append(getattr(step, "rows", None))
        return hidden(tokens, positions, step)

    eng.prefix_sharing, eng.model.hidden = sharing, counting
    try:
        return eng.generate(prompts, params), [r for r in rows if r is not None]
    finally:
        eng.prefix_sharing, eng.model.hidden = True, hidden


@pytest.mark.parametrize("family", ["llama2", "qwen3-moe", "qwen3-next"])  # qwen3-next: recurrent states move too
def test_shared_prefill_equals_the_unshared_path(engine, family: str) -> None:
    eng = engine(family, max_batch_size=6)
    a, b, c = random_prompts((9, 5, 12), seed=30)
    # Groups of 4, 3 and 2 interleaved; 9 requests on 6 slots: the third admission holds a group's rest.
    prompts = [a, a, b, a, c, b, a, b, c]
    sampled = [
        SamplingParams(max_new_tokens=n, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i, n in enumerate((6, 4, 6, 5, 6, 3, 6, 6, 2))
    ]
    greedy = [SamplingParams(max_new_tokens=5, ignore_eos=True)] * len(prompts)
    for params in (sampled, greedy):
        shared, shared_rows = _run(eng, prompts, params, True)
        alone, alone_rows = _run(eng, prompts, params, False)
        assert [o.token_ids for o in shared] == [o.token_ids for o in alone]
        for s, u in zip(shared, alone):
            assert max(abs(x - y) for x, y in zip(s.logprobs, u.logprobs)) < 1e-5
        assert sum(alone_rows) == len(prompts)  # every request prefilled its own prompt
        assert shared_rows[0] == 3 and sum(shared_rows) < len(prompts)
        if params is sampled:  # the samples of one group differ (own seeds), though they share the prompt's cache
            assert len({tuple(o.token_ids) for o, p in zip(shared, prompts) if p == a}) > 1
