"""A generation session (requests submitted between steps) gives every request what ``generate`` gives it."""

from __future__ import annotations

import pytest

from mindspeed_llm.inference import GenerationSession, SamplingParams
from tests.llm.inference.conftest import random_prompts


@pytest.mark.parametrize("family", ["llama2", "qwen3-next"])  # qwen3-next: recurrent states move with the slots
def test_staggered_requests_equal_generate(engine, family: str) -> None:
    eng = engine(family, max_batch_size=3)
    a, b, c, d = random_prompts((9, 5, 12, 7), seed=41)
    prompts = [a, b, a, c, d, b, c]  # repeated prompts: prefix sharing inside the session too
    params = [
        SamplingParams(max_new_tokens=n, temperature=1.0, top_p=0.9, seed=300 + i, ignore_eos=True)
        for i, n in enumerate((6, 3, 8, 5, 2, 7, 4))
    ]
    params[4] = SamplingParams(max_new_tokens=5, ignore_eos=True)  # a greedy one among them
    reference = eng.generate(prompts, params)

    session = GenerationSession(eng, slots=3, max_len=32)
    got: dict[int, object] = {}
    # Two requests first; the others arrive one per step (some while every slot is busy), and
    # one more the moment a request finishes (a follow-up, as a multi-turn rollout sends).
    ids = [session.submit(prompts[i], params[i]) for i in range(2)]
    queue = list(range(2, len(prompts)))
    steps = 0
    while session.busy or queue:
        for key, out in session.step():
            got[key] = out
            if queue:
                ids.append(session.submit(prompts[queue[0]], params[queue.pop(0)]))
        if queue and steps % 2 == 0:
            ids.append(session.submit(prompts[queue[0]], params[queue.pop(0)]))
        steps += 1
    assert ids == list(range(len(prompts)))
    assert steps > max(p.max_new_tokens for p in params)  # the requests ran interleaved, not all at once
    for i, ref in enumerate(reference):
        out = got[i]
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.token_ids == ref.token_ids, i
        assert out.finish_reason == ref.finish_reason
        assert max(abs(x - y) for x, y in zip(out.logprobs, ref.logprobs)) < 1e-5


def test_a_request_beyond_the_session_cache_is_refused(engine) -> None:
    eng = engine("llama2", max_batch_size=2)
    session = GenerationSession(eng, slots=2, max_len=64)
    with pytest.raises(ValueError, match="cache positions"):
        session.submit(list(range(3, 60)), SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="slots=0"):
        GenerationSession(eng, slots=0, max_len=64)
