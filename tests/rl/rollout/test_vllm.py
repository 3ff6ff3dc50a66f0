"""The vllm rollout engine's glue, against a fake ``vllm`` module.

vLLM is not installed here (and has no CPU wheel), so these tests prove the translation, not
vLLM: how :class:`~mindspeed_llm.inference.SamplingParams` become ``vllm.SamplingParams``, how
``RequestOutput`` objects become rollout outputs, which ``LLM`` arguments are passed, and in what
order sleep / wake-up / weight sync / prefix-cache reset reach the ``LLM``. The fake follows the
public API the module documents (``LLM``, ``SamplingParams``, ``inputs.TokensPrompt``,
``collective_rpc`` running a worker-extension method on every worker).
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from mindspeed_llm.inference import SamplingParams
from mindspeed_rl.rollout import VLLMRollout, build_rollout
from mindspeed_rl.rollout.vllm import WORKER_EXTENSION, WeightSyncExtension, weight_buckets


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    outputs: list[Completion]


class FakeModel:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        names = set()
        for name, tensor in weights:
            self.loaded[name] = tensor
            names.add(name)
        return names


class FakeWorker(WeightSyncExtension):
    """What vLLM builds from ``worker_extension_cls``: its worker with our methods mixed in."""

    def __init__(self) -> None:
        self.model_runner = types.SimpleNamespace(model=FakeModel())


class FakeLLM:
    """Scripted ``vllm.LLM``: response token ``t`` of a prompt is ``prompt[0] + t``, its logprob ``-0.1 * (t + 1)``."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.workers = [FakeWorker() for _ in range(kwargs.get("tensor_parallel_size", 1))]
        self.finish = ["stop", "length", None]

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append(("generate", len(prompts), use_tqdm))
        self.prompts, self.params = prompts, sampling_params
        out = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            first = prompt["prompt_token_ids"][0]
            tokens = [first + t for t in range(params.kwargs["max_tokens"])]
            # vLLM puts the sampled token in each step's dict, with other top tokens when asked for.
            steps = [{tok: Logprob(-0.1 * (t + 1)), tok + 1000: Logprob(-9.0)} for t, tok in enumerate(tokens)]
            out.append(RequestOutput([Completion(tokens, steps, self.finish[i % 3])]))
        return out

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method, tuple(name for name, _ in args[0])))
        return [getattr(worker, method)(*args, **(kwargs or {})) for worker in self.workers]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


class FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.0.fake"
    vllm.LLM, vllm.SamplingParams = FakeLLM, FakeSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # a TypedDict in vLLM: calling it makes a dict
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return vllm


def test_llm_arguments_and_worker_extension(fake_vllm) -> None:
    engine = build_rollout(
        "vllm",
        "/models/x",
        max_num_seqs=16,
        tp=2,
        gpu_memory_utilization=0.4,
        seed=9,
        max_model_len=300,
        enforce_eager=True,
    )
    assert isinstance(engine, VLLMRollout)
    assert engine.llm.kwargs == {
        "model": "/models/x",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.4,
        "enable_sleep_mode": True,
        "seed": 9,
        "max_num_seqs": 16,
        "worker_extension_cls": WORKER_EXTENSION,
        "logprobs_mode": "raw_logprobs",
        "max_model_len": 300,
        "enforce_eager": True,
    }
    # vLLM imports the extension by this name in each worker process.
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is WeightSyncExtension
    assert "max_model_len" not in build_rollout("vllm", "/models/x").llm.kwargs


def test_sampling_params_and_outputs_translation(fake_vllm) -> None:
    engine = build_rollout("vllm", "/models/x")
    prompts = [[5, 6, 7], [40], [9, 9]]
    params = [
        SamplingParams(max_new_tokens=3),
        SamplingParams(max_new_tokens=2, temperature=0.7, top_k=20, top_p=0.9, seed=4, stop_token_ids=(2, 3)),
        SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True),
    ]
    out = engine.generate(prompts, params)
    assert engine.llm.prompts == [{"prompt_token_ids": p} for p in prompts]
    assert [p.kwargs for p in engine.llm.params] == [
        dict(
            n=1,
            temperature=0.0,
            top_p=1.0,
            top_k=-1,
            max_tokens=3,
            seed=None,
            stop_token_ids=[],
            ignore_eos=False,
            logprobs=0,
            detokenize=False,
        ),
        dict(
            n=1,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            max_tokens=2,
            seed=4,
            stop_token_ids=[2, 3],
            ignore_eos=False,
            logprobs=0,
            detokenize=False,
        ),
        dict(
            n=1,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_tokens=4,
            seed=None,
            stop_token_ids=[],
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        ),
    ]
    assert engine.llm.calls == [("generate", 3, False)]
    assert [o.prompt_token_ids for o in out] == prompts
    assert [o.token_ids for o in out] == [[5, 6, 7], [40, 41], [9, 10, 11, 12]]
    assert [o.logprobs for o in out] == [[-0.1, -0.2, -0.1 * 3], [-0.1, -0.2], [-0.1, -0.2, -0.1 * 3, -0.4]]
    assert [o.finish_reason for o in out] == ["stop", "length", "length"]  # None (unfinished) -> length
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        engine.generate(prompts, params[:2])


def test_sleep_weight_sync_wake_order(fake_vllm) -> None:
    engine = build_rollout("vllm", "/models/x", tp=2)
    state = {"model.embed_tokens.weight": torch.randn(4, 3), "lm_head.weight": torch.randn(4, 3, dtype=torch.bfloat16)}
    engine.sleep()
    engine.sleep()  # once is enough
    engine.load_weights(state)
    assert engine.llm.calls == [
        ("sleep", 1),
        ("wake_up", ("weights",)),
        ("collective_rpc", "mindspeed_load_weights", tuple(state)),
    ]
    for worker in engine.llm.workers:  # every tensor-parallel worker gets the full tensors
        assert worker.model_runner.model.loaded.keys() == state.keys()
        for name, tensor in state.items():
            assert torch.equal(worker.model_runner.model.loaded[name], tensor)
    engine.llm.calls.clear()
    engine.generate([[1, 2]], [SamplingParams(max_new_tokens=1)])  # wakes the KV cache, drops stale prefixes
    assert engine.llm.calls == [("wake_up", ("kv_cache",)), ("reset_prefix_cache",), ("generate", 1, False)]
    engine.llm.calls.clear()
    engine.wake_up()
    engine.generate([[1, 2]], [SamplingParams(max_new_tokens=1)])
    assert engine.llm.calls == [("generate", 1, False)]
    engine.sleep()
    engine.wake_up()
    assert engine.llm.calls[-2:] == [("sleep", 1), ("wake_up", ("weights", "kv_cache"))]
    with pytest.raises(ValueError, match="sleep_level"):
        build_rollout("vllm", "/models/x", sleep_level=3)


def test_weight_buckets_bound_the_message_size() -> None:
    state = {f"w{i}": torch.zeros(10, dtype=torch.float32) for i in range(5)}  # 40 bytes each
    state["big"] = torch.zeros(100)
    buckets = weight_buckets(state, limit=100)
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"], ["big"]]
    assert all(t.device.type == "cpu" for b in buckets for _, t in b)


def test_missing_vllm_names_the_extra_and_the_builtin_engine(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail, as when it is not installed
    with pytest.raises(ValueError, match=r"uv sync --extra vllm.*mindspeed-rl\[vllm\].*rollout.engine=builtin"):
        build_rollout("vllm", "/models/x")
