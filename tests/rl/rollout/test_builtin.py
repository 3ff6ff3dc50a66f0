"""The builtin rollout engine against the InferenceEngine it wraps, and the registry."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_llm.inference import InferenceEngine, SamplingParams
from mindspeed_rl.rollout import ROLLOUT_ENGINES, BuiltinRollout, RolloutEngine, build_rollout


def prompts_and_params() -> tuple[list[list[int]], list[SamplingParams]]:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (5, 9, 3, 7)]
    params = [
        SamplingParams(max_new_tokens=8, ignore_eos=True),  # greedy
        SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=7, temperature=0.8, top_k=20, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=1.2, seed=13, stop_token_ids=(50, 60, 70)),
    ]
    return prompts, params


def outputs(result) -> list[tuple]:
    return [(o.prompt_token_ids, o.token_ids, o.logprobs, o.finish_reason) for o in result]


def read_state(directory) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def test_generates_what_the_inference_engine_generates(tiny_dirs) -> None:
    rollout = build_rollout("builtin", tiny_dirs["old"], max_num_seqs=2, max_model_len=40, seed=5)
    assert isinstance(rollout, BuiltinRollout) and isinstance(rollout, RolloutEngine)
    reference = InferenceEngine.from_pretrained(tiny_dirs["old"], max_batch_size=2, max_seq_len=40)
    prompts, params = prompts_and_params()
    got = rollout.generate(prompts, params)
    assert outputs(got) == outputs(reference.generate(prompts, params))
    assert [len(o.token_ids) for o in got[:3]] == [8, 6, 7]
    # Requests without a seed get one from the engine's seed: repeatable, and not all alike.
    unseeded = [SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)] * 4
    first = outputs(rollout.generate(prompts, unseeded))
    again = build_rollout("builtin", tiny_dirs["old"], max_num_seqs=2, max_model_len=40, seed=5)
    assert outputs(again.generate(prompts, unseeded)) == first
    other = build_rollout("builtin", tiny_dirs["old"], max_num_seqs=2, max_model_len=40, seed=6)
    assert outputs(other.generate(prompts, unseeded)) != first
    with pytest.raises(ValueError, match="3 SamplingParams for 4 prompts"):
        rollout.generate(prompts, params[:3])


def test_load_weights_gives_the_new_models_generations(tiny_dirs) -> None:
    rollout = build_rollout("builtin", tiny_dirs["old"], max_num_seqs=4)
    fresh = build_rollout("builtin", tiny_dirs["new"], max_num_seqs=4)
    prompts, params = prompts_and_params()
    before = outputs(rollout.generate(prompts, params))
    want = outputs(fresh.generate(prompts, params))
    assert before != want
    state = read_state(tiny_dirs["new"])
    rollout.sleep()  # the co-located order: sleep, sync while asleep, generate (wakes itself)
    first = {k: v for k, v in state.items() if "q_proj" in k or "gate_proj" in k}
    rollout.load_weights(first)  # in two buckets that split the fused weights
    rollout.load_weights({k: v for k, v in state.items() if k not in first})
    assert outputs(rollout.generate(prompts, params)) == want


def test_sleep_wake_up_round_trip(tiny_dirs) -> None:
    rollout = build_rollout("builtin", tiny_dirs["old"], max_num_seqs=4)
    prompts, params = prompts_and_params()
    want = outputs(rollout.generate(prompts, params))
    assert rollout.engine.cache is not None
    rollout.sleep()
    assert rollout.asleep and rollout.engine.cache is None
    rollout.wake_up()
    assert not rollout.asleep
    assert outputs(rollout.generate(prompts, params)) == want
    rollout.sleep()
    assert outputs(rollout.generate(prompts, params)) == want and not rollout.asleep


def test_registry_and_settings_errors(tiny_dirs) -> None:
    assert {"builtin", "vllm"} <= set(ROLLOUT_ENGINES.keys())
    with pytest.raises(ValueError, match="unknown rollout engine 'vlm'.*Did you mean 'vllm'"):
        build_rollout("vlm", tiny_dirs["old"])
    with pytest.raises(ValueError, match="builtin rollout engine runs on one device, got tp=2"):
        build_rollout("builtin", tiny_dirs["old"], tp=2)
    for bad, match in (
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"tp": 0}, "tp must"),
    ):
        with pytest.raises(ValueError, match=match):
            build_rollout("builtin", tiny_dirs["old"], **bad)


@pytest.mark.slow  # cold, the two graphs take ~30 s to compile on a busy 2-core machine
def test_compiled_rollout_gives_the_uncompiled_tokens(tiny_dirs) -> None:
    from mindspeed.compile import CompileWatch
    from mindspeed_rl.config.sections import RolloutConfig

    # ``rollout.compile``: the builtin engine's option; another engine refuses it in one line.
    with pytest.raises(Exception, match="rollout.compile=true compiles the builtin engine"):
        RolloutConfig(engine="vllm", compile=True).check()
    rollout = build_rollout("builtin", tiny_dirs["old"], max_num_seqs=2, max_model_len=40, seed=5, compile=True)
    plain = build_rollout("builtin", tiny_dirs["old"], max_num_seqs=2, max_model_len=40, seed=5)
    assert rollout.engine.compiled is not None and plain.engine.compiled is None
    prompts, params = prompts_and_params()
    got, want = rollout.generate(prompts, params), plain.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    # After a weight sync (asleep, in place), the new model's tokens, and no graph compiled again.
    watch = CompileWatch()
    state = read_state(tiny_dirs["new"])
    for engine in (rollout, plain):
        engine.sleep()
        engine.load_weights(state)
    assert outputs(rollout.generate(prompts, params))[0][1] != want[0].token_ids
    assert [o.token_ids for o in rollout.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]
    assert watch.graphs() == 0
