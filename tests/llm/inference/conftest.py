"""Engines and transformers models on the tiny checkpoints, built once per test session."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mindspeed_llm.bridges import families_with
from mindspeed_llm.inference import InferenceEngine

#: Every family whose bridge declares ``infers`` (tied embeddings: qwen25; MoE: mixtral, qwen3-moe;
#: llama3 rope: llama2; MLA, sigmoid routing, shared experts: deepseek3; gated shared expert: qwen2-moe;
#: sliding/global layers with two rope bases, post-norms, (1 + w) norms, GeGLU, soft-cap: gemma3;
#: partial rotary, q/k/v biases with QK norm, sigmoid routing with a non-zero expert bias: glm45-moe;
#: sinks, sliding/full layers, YaRN, router and expert biases, clamped SwiGLU: gpt-oss),
#: each proven against transformers.
FAMILIES = families_with("infers")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these models are too small to gain from more, and on a busy machine
    (CI has 2 cores shared with other jobs) waiting for a second thread costs up to 50x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoints) -> Callable[[str], torch.nn.Module]:
    """``hf_model(family)``: the transformers model of a tiny checkpoint (eager attention, eval mode)."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, torch.nn.Module] = {}

    def load(family: str) -> torch.nn.Module:
        if family not in cache:
            cache[family] = AutoModelForCausalLM.from_pretrained(
                tiny_checkpoints[family], dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return cache[family]

    return load


@pytest.fixture(scope="session")
def engine(tiny_checkpoints) -> Callable[..., InferenceEngine]:
    """``engine(family, max_batch_size=8)``: an engine on a tiny checkpoint (cached per arguments)."""
    cache: dict[tuple, InferenceEngine] = {}

    def load(family: str, max_batch_size: int = 8, **kwargs) -> InferenceEngine:
        key = (family, max_batch_size, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = InferenceEngine.from_pretrained(
                tiny_checkpoints[family], max_batch_size=max_batch_size, **kwargs
            )
        return cache[key]

    return load


def random_prompts(lengths: tuple[int, ...], vocab: int = 128, seed: int = 0) -> list[list[int]]:
    """Random token ids (3 .. vocab-1: no special tokens of the tiny tokenizer) of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def teacher_forced_greedy(engine: InferenceEngine, prompt: list[int], generated: list[int]) -> list[int]:
    """The greedy tokens of the reference path, checked against ``generated``.

    One full forward without cache over ``prompt + generated``: by causality its logits at position
    ``t`` are those of the prefix ``[:t + 1]``, so its argmax at the generated positions equals the
    greedy tokens of re-running the forward on the growing sequence whenever ``generated`` is greedy.
    """
    logits = engine.forward_logits(prompt + generated)
    return logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()


def regrown_greedy(engine: InferenceEngine, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of the reference path, literally: a full forward on the growing sequence per token."""
    sequence = list(prompt)
    for _ in range(steps):
        sequence.append(int(engine.forward_logits(sequence)[-1].argmax()))
    return sequence[len(prompt) :]
