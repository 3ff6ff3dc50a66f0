"""``compile=True``: the decode step under ``torch.compile`` gives the eager engine's tokens and transformers' ones.

One compiled engine (tiny Llama, 4 slots: buckets 1, 2, 4) serves the whole module, so its
graphs are compiled once (about 3 graphs; tens of seconds on a 2-core machine):

- greedy tokens of one prompt, and of seven prompts of different lengths and lengths of output
  on four slots (requests join as others leave; the running count goes 4, 3, 2, 1, so the
  padded bucket 4 and buckets 2 and 1 all run), equal the eager engine's and transformers'
  ``generate``'s; log-probabilities within 1e-5;
- sampled tokens with per-request seeds equal the eager engine's: the sampler's noise is
  counter-based per request (:mod:`mindspeed_llm.inference.sampling`), so a request's tokens
  depend on its seed and its logits only, not on the padded bucket it ran in;
- after the first call compiled the buckets' graphs, running the same mixed workload again,
  and after new weights (RL weight sync, in place), compiles nothing (dynamo's counters);
- models with routed experts and unknown modes are refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed.compile import CompileWatch
from mindspeed_llm.inference import InferenceEngine, SamplingParams
from mindspeed_llm.inference.compiled import CompiledDecode
from mindspeed_llm.inference.packed import PackedLinear, mkl_packing_available
from tests.llm.inference.conftest import random_prompts

FAMILY = "llama2"
#: Seven prompts, each its own output length, on four slots.
LENGTHS, NEW_TOKENS = (7, 2, 11, 4, 9, 3, 6), (9, 3, 7, 5, 6, 4, 8)


@pytest.fixture(scope="module")
def engines(tiny_checkpoints) -> tuple[InferenceEngine, InferenceEngine]:
    """The eager engine and the compiled one on the same checkpoint (one decode step a graph call: the
    multi-step greedy graphs have a test of their own, whose compile time this one need not pay)."""
    path = tiny_checkpoints[FAMILY]
    compiled = InferenceEngine.from_pretrained(path, max_batch_size=4, compile=True)
    compiled.compiled = CompiledDecode(compiled.model, 4, chunk=1)
    return InferenceEngine.from_pretrained(path, max_batch_size=4), compiled


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _transformers(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow  # cold, the three graphs take ~1 min to compile on a busy 2-core machine
def test_compiled_decode_equals_eager_and_transformers_without_recompiling(engines, hf_model) -> None:
    eager, compiled = engines
    model = hf_model(FAMILY)
    assert compiled.compiled.buckets == (1, 2, 4) and eager.compiled is None
    # Bucket 4 multiplies by MKL-packed weights (buckets 1 and 2 keep the plain GEMM); the new weights below are repacked.
    assert compiled.compiled.packed is not None and compiled.compiled.packed.rows == (4,)

    (prompt,) = random_prompts((6,), seed=20)
    watch = CompileWatch()
    (one,) = compiled.generate([prompt], _greedy(12))
    assert watch.graphs() == 1 and compiled.cache.num_slots == 4  # bucket 1; every slot, so the strides stay
    assert one.token_ids == eager.generate([prompt], _greedy(12))[0].token_ids == _transformers(model, prompt, 12)

    prompts = random_prompts(LENGTHS, seed=21)
    params = [_greedy(n) for n in NEW_TOKENS]
    first = CompileWatch()
    got = compiled.generate(prompts, params)
    assert first.graphs() == 2  # buckets 4 and 2 (1 is compiled already)
    want = eager.generate(prompts, params)
    for index, (prompt, n, a, b) in enumerate(zip(prompts, NEW_TOKENS, got, want)):
        assert a.token_ids == b.token_ids == _transformers(model, prompt, n), f"request {index}"
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)

    again = CompileWatch()
    assert [o.token_ids for o in compiled.generate(prompts, params)] == [o.token_ids for o in got]
    assert again.graphs() == 0

    # Sampling: per-request seeds give the eager engine's tokens, whichever bucket a request ran in.
    sampled = [
        SamplingParams(max_new_tokens=n, temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i, n in enumerate(NEW_TOKENS)
    ]
    assert [o.token_ids for o in compiled.generate(prompts, sampled)] == [
        o.token_ids for o in eager.generate(prompts, sampled)
    ]

    # New weights arrive in place (RL weight sync): the graphs read them, nothing is compiled again.
    generator = torch.Generator().manual_seed(22)
    state = {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
        if name.endswith("mlp.down_proj.weight")
    }
    for engine in engines:
        engine.load_weights(state)
    assert (
        [o.token_ids for o in compiled.generate(prompts, params)]
        == [o.token_ids for o in eager.generate(prompts, params)]
        != [o.token_ids for o in got]
    )
    assert again.graphs() == 0


@pytest.mark.slow  # the three graphs of bucket 1 (two greedy steps a call, two sampled, and one)
def test_chunks_equal_eager_and_transformers(tiny_checkpoints, hf_model) -> None:
    """Several decode steps per graph call (the token choice inside the graph): greedy, the eager engine's and
    transformers' tokens; a stop token inside a chunk drops the chunk's later tokens; seeded sampling
    (temperature, top-k, top-p), the eager engine's tokens; nothing compiled after warm-up."""
    path = tiny_checkpoints[FAMILY]
    eager = InferenceEngine.from_pretrained(path, max_batch_size=1)
    engine = InferenceEngine.from_pretrained(path, max_batch_size=1, compile=True)
    engine.compiled = CompiledDecode(engine.model, 1, chunk=2)
    calls: list[int] = []
    chunked = engine.compiled.greedy_steps
    engine.compiled.greedy_steps = lambda *args: calls.append(args[3]) or chunked(*args)
    model = hf_model(FAMILY)
    prompts = random_prompts((6, 3), seed=23)
    watch = CompileWatch()
    got = engine.generate(prompts, _greedy(10))  # one request at a time: 9 decode steps, 4 chunks + 1 step
    assert watch.graphs() == 2 and calls == [2] * 8
    want = eager.generate(prompts, _greedy(10))
    for prompt, a, b in zip(prompts, got, want):
        assert a.token_ids == b.token_ids == _transformers(model, prompt, 10)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    # A stop token at the first step of a chunk: the request ends there, as in the eager engine.
    stop = got[0].token_ids[3]  # the 4th token: step 1 of the second chunk
    first = got[0].token_ids.index(stop) + 1
    stopped = SamplingParams(max_new_tokens=10, stop_token_ids=(stop,), ignore_eos=True)
    (out,) = engine.generate(prompts[:1], stopped)
    assert out.token_ids == got[0].token_ids[:first] == eager.generate(prompts[:1], stopped)[0].token_ids
    assert out.finish_reason == "stop" and len(out.logprobs) == first
    # Sampled requests (a greedy one among them): drawn inside the graph, the eager sampler's tokens.
    sampled = [
        SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=100, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=1.3, seed=101, ignore_eos=True),
        SamplingParams(max_new_tokens=10, top_p=0.8, temperature=0.7, seed=102, ignore_eos=True),
        _greedy(10),
    ]
    drawn = []
    sampled_chunks = engine.compiled.sampled_steps
    engine.compiled.sampled_steps = lambda *args: drawn.append(args[3]) or sampled_chunks(*args)
    prompts4 = prompts + random_prompts((5, 8), seed=24)
    got_sampled = engine.generate(prompts4, sampled)
    assert drawn == [2] * 12 and watch.graphs() == 3  # 3 sampled requests x 4 chunks; one more graph
    for a, b in zip(got_sampled, eager.generate(prompts4, sampled)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    again = CompileWatch()
    assert [o.token_ids for o in engine.generate(prompts, _greedy(10))] == [o.token_ids for o in got]
    assert [o.token_ids for o in engine.generate(prompts4, sampled)] == [o.token_ids for o in got_sampled]
    assert again.graphs() == 0


@pytest.mark.skipif(not mkl_packing_available(torch.device("cpu"), torch.float32), reason="torch without MKL")
def test_packed_linear_equals_linear_and_follows_new_weights() -> None:
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(48, 32, generator=generator), torch.randn(48, generator=generator)
    packed = PackedLinear([weight, weight], rows=(4, 8))
    assert list(packed.packs) == [weight] and packed.nbytes > 0
    for rows in (4, 8, 3):  # 3 rows: no pack, the plain GEMM
        x = torch.randn(rows, 32, generator=generator)
        torch.testing.assert_close(packed(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    with torch.no_grad():
        weight.mul_(-2.0)
    x = torch.randn(8, 32, generator=generator)
    stale = packed(x, weight)
    packed.repack()
    torch.testing.assert_close(packed(x, weight), torch.nn.functional.linear(x, weight))
    assert not torch.allclose(stale, packed(x, weight))  # the old pack was the old weight


def test_compile_refuses_routed_experts_and_unknown_modes(tiny_checkpoints) -> None:
    with pytest.raises(ValueError, match="compile=True needs a dense model"):
        InferenceEngine.from_pretrained(tiny_checkpoints["qwen3-moe"], compile=True)
    with pytest.raises(ValueError, match="compile='fastest': use True, False or a mode"):
        InferenceEngine.from_pretrained(tiny_checkpoints[FAMILY], compile="fastest")


@pytest.mark.slow  # two more graphs (buckets 1 and 2 of another model)
def test_compiled_sliding_window_equals_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from mindspeed_llm.testing.tiny_models import TINY_CONFIGS

    config = TINY_CONFIGS.get("mistral")()
    config.sliding_window = 4  # shorter than the sequences: keys leave the window during decoding
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(tmp_path)
    compiled = InferenceEngine.from_pretrained(tmp_path, max_batch_size=2, compile=True)
    prompts = random_prompts((9, 3, 6), seed=2)  # three prompts on two slots
    steps, step = [], compiled.compiled.logits
    compiled.compiled.logits = lambda *args: steps.append(len(args[1])) or step(*args)
    outs = compiled.generate(prompts, _greedy(8))
    assert [o.token_ids for o in outs] == [_transformers(model, p, 8) for p in prompts]
    assert sum(steps) == 3 * 7  # every decoded token came from the compiled step (the first from the prefill)


def test_generate_cli_compile_flag_reaches_the_engine(monkeypatch) -> None:
    import argparse

    from mindspeed_llm.inference import cli

    seen: dict = {}

    def from_pretrained(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(cli.InferenceEngine, "from_pretrained", from_pretrained)
    parser = argparse.ArgumentParser()
    cli.add_generate(parser.add_subparsers())
    for flags, want in (([], False), (["--compile"], True)):
        args = parser.parse_args(["generate", "--load-dir", "x", "--prompt", "hi", *flags])
        with pytest.raises(ValueError, match="stop here"):
            cli.run_generate(args)
        assert seen["compile"] is want
