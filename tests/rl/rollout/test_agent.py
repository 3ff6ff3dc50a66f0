"""The agent loop against the chat template: what it appends, what it masks, and every way a call fails.

A scripted engine (it honours ``max_new_tokens`` and the stop ids, as an engine does) writes
each sample's turns; the real tools run. For every sample the prompt plus the response must
decode to exactly the chat template's rendering of the whole conversation (so the appended
tokens are the template's), the loss mask must be 1 on exactly the scripted (generated) tokens,
and the log-probs must be the engine's there and 0 elsewhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mindspeed_llm.engine import GenerationOutput, SamplingParams
from mindspeed_rl.rollout.agent import AgentLoop, AgentSettings, agent_metrics
from mindspeed_rl.tools import QWEN25_TOOLS_TEMPLATE, TOOLS, Tool, ToolError, build_tools
from tests.rl.tools.test_render import byte_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 59"}}\n</tool_call>'


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class Scripted:
    """An engine whose sample ``i`` writes ``scripts[i][turn]`` (cut at a stop id or ``max_new_tokens``)."""

    def __init__(self, tokenizer: Any, scripts: list[list[str]], prompts: list[list[int]]) -> None:
        self.tokenizer, self.scripts, self.first = tokenizer, scripts, prompts
        self.turn = [0] * len(scripts)
        self.contexts: list[list[list[int]]] = [[] for _ in scripts]
        self.calls = 0

    def __call__(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
        self.calls += 1
        out = []
        for prompt, p in zip(prompts, params):
            i = next(k for k, ctx in enumerate(self.contexts) if self._mine(k, prompt))
            self.contexts[i].append(list(prompt))
            text = self.scripts[i][min(self.turn[i], len(self.scripts[i]) - 1)]
            self.turn[i] += 1
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            stops = set(p.stop_token_ids) | {self.tokenizer.eos_token_id}
            cut = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
            reason = "stop" if cut <= p.max_new_tokens and ids[cut - 1] in stops else "length"
            ids = ids[: min(cut, p.max_new_tokens)]
            logprobs = [-0.01 * (k + 1) - self.turn[i] for k in range(len(ids))]
            out.append(GenerationOutput(list(prompt), ids, logprobs, reason))
        return out

    def _mine(self, k: int, prompt: list[int]) -> bool:
        return prompt[: len(self.first[k])] == self.first[k] and (
            not self.contexts[k] or prompt[: len(self.contexts[k][-1])] == self.contexts[k][-1]
        )


class StepwiseScripted:
    """The scripted engine behind both interfaces: ``generate`` (barrier) and ``session`` (overlapped).

    A session step finishes the oldest waiting request only, so the samples' turns close one at a
    time and their tools run while the others are still "decoding".
    """

    def __init__(self, engine: Scripted) -> None:
        self.engine, self.generate = engine, engine
        self.queue: list[tuple[int, list[int], SamplingParams]] = []
        self.submitted = 0
        self.opened: list[tuple[int, int]] = []

    def session(self, slots: int, max_len: int) -> StepwiseScripted:
        self.opened.append((slots, max_len))
        return self

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        self.queue.append((self.submitted, list(prompt), params))
        self.submitted += 1
        return self.submitted - 1

    def step(self) -> list[tuple[int, GenerationOutput]]:
        key, prompt, params = self.queue.pop(0)
        return [(key, self.engine([prompt], [params])[0])]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_tokenizer(QWEN25_TOOLS_TEMPLATE)


TEST_TOOLS = ("boom", "slow", "picky")


@pytest.fixture
def test_tools() -> Iterator[None]:
    """The failing tools, registered for one test only (other tests read the registry's names)."""

    def boom(arguments: dict) -> str:
        raise RuntimeError("the tool broke")

    def slow(arguments: dict) -> str:
        time.sleep(1.0)
        return "late"

    def picky(arguments: dict) -> str:
        raise ToolError("error: picky refuses", "refused")

    for name, fn in zip(TEST_TOOLS, (boom, slow, picky)):
        TOOLS.register(name, lambda name=name, fn=fn: Tool(name, name, {"type": "object", "properties": {}}, fn))
    try:
        yield
    finally:
        for name in TEST_TOOLS:
            TOOLS.unregister(name)


@pytest.mark.parametrize("overlap", [False, True], ids=["barrier", "overlapped"])
def test_turns_masks_and_failures_against_the_template(tokenizer: Any, overlap: bool, test_tools: None) -> None:
    tools = build_tools(["calculator", "python", "boom", "slow", "picky"])
    settings = AgentSettings(
        tools, max_turns=4, max_response_length=800, max_parallel=4, timeout_s=0.3, overlap=overlap
    )
    loop = AgentLoop(tokenizer, settings)
    answer = "The answer is 2183.<|im_end|>"
    scripts = [
        ["Let me compute.\n" + CALL + " trailing text the stop cuts", answer],  # a call, then the answer
        ["<tool_call>\n{not json}\n</tool_call>", answer],  # malformed
        [call("nope", "{}") + "<|im_end|>", answer],  # unknown tool
        [call("boom", "{}"), call("slow", "{}"), call("picky", "{}"), answer],  # exception, timeout, ToolError
        [CALL] * 5,  # calls until max_turns
        ["No tools needed: 4.<|im_end|>"],  # an answer at once
        [call("calculator", '{"expression": 2}'), answer],  # arguments that do not fit the schema
        ["<tool_call>\n" + "x" * 500],  # an unclosed call running into max_response_length
    ]
    questions = [f"question {i}" for i in range(len(scripts))]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    prompts = [tokenizer(loop.prompt_text(c), add_special_tokens=False)["input_ids"] for c in conversations]
    engine = StepwiseScripted(Scripted(tokenizer, scripts, prompts))
    params = [SamplingParams(max_new_tokens=300, temperature=1.0, seed=i) for i in range(len(prompts))]
    outputs = loop.run(engine, prompts, params, conversations)
    assert engine.opened == ([(len(prompts), max(map(len, prompts)) + 800)] if overlap else [])

    eos = tokenizer.eos_token_id
    for i, out in enumerate(outputs):
        n = len(out.token_ids)
        assert len(out.logprobs) == len(out.loss_mask) == n
        # Generated tokens: the engine's log-probs, mask 1; appended ones: 0 and 0.
        generated = [t for t, m in zip(out.token_ids, out.loss_mask) if m]
        scripted = []
        for turn in range(out.turns):
            ids = tokenizer(scripts[i][min(turn, len(scripts[i]) - 1)], add_special_tokens=False)["input_ids"]
            stops = {eos, loop.close_id}
            cut = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
            scripted += ids[: min(cut, 300)]
        assert generated == scripted[: len(generated)], i
        assert all(lp == 0.0 for lp, m in zip(out.logprobs, out.loss_mask) if not m)
        assert all(lp < 0 for lp, m in zip(out.logprobs, out.loss_mask) if m)
        if out.finish_reason in ("stop", "max_turns"):
            # prompt + response is the template's rendering of the conversation (less the newline after the
            # final end-of-turn token, which the model does not write).
            text = tokenizer.decode(out.prompt_token_ids + out.token_ids, skip_special_tokens=False)
            rendered = tokenizer.apply_chat_template(
                conversations[i] + out.messages, tools=loop.schemas, tokenize=False
            )
            last = out.messages[-1]
            if last["role"] == "assistant" and out.finish_reason == "max_turns":
                rendered = rendered[: rendered.rfind(last["content"]) + len(last["content"])]
            assert text == rendered.removesuffix("\n"), (i, text[-300:], rendered[-300:])

    by_sample = [(o.finish_reason, o.turns, o.tool_calls, dict(o.tool_errors)) for o in outputs]
    assert by_sample[0] == ("stop", 2, 1, {})  # the prompt's own <tool_call> examples are not parsed
    assert by_sample[1] == ("stop", 2, 1, {"malformed_call": 1})
    assert by_sample[2] == ("stop", 2, 1, {"unknown_tool": 1})
    assert by_sample[3] == ("stop", 4, 3, {"exception": 1, "timeout": 1, "refused": 1})
    assert by_sample[4] == ("max_turns", 4, 3, {})
    assert by_sample[5] == ("stop", 1, 0, {})
    assert by_sample[6] == ("stop", 2, 1, {"bad_arguments": 1})
    assert by_sample[7][0] == "length" and len(outputs[7].token_ids) == 800

    tool_text = [m["content"] for m in outputs[0].messages if m["role"] == "tool"]
    assert tool_text == ["2183"]
    assert "malformed tool call" in outputs[1].messages[1]["content"]
    assert "unknown tool 'nope'" in outputs[2].messages[1]["content"]

    metrics = agent_metrics(outputs)
    assert metrics["tools/calls"] == sum(o.tool_calls for o in outputs) / len(outputs)
    assert metrics["tools/call_rate"] == 7 / 8
    assert metrics["tools/errors/malformed_call"] > 0 and metrics["tools/time_s"] > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["barrier", "overlapped"])
def test_calls_run_at_once_across_samples(tokenizer: Any, overlap: bool) -> None:
    active, peak, lock = [0], [0], threading.Lock()

    def wait(arguments: dict) -> str:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        return "ok"

    tools = {"wait": Tool("wait", "w", {"type": "object", "properties": {}}, wait)}
    loop = AgentLoop(tokenizer, AgentSettings(tools, max_turns=2, max_parallel=3, timeout_s=5, overlap=overlap))
    scripts = [[call("wait", "{}"), "done<|im_end|>"] for _ in range(4)]
    prompts = [tokenizer(loop.prompt_text([{"role": "user", "content": f"q{i}"}]))["input_ids"] for i in range(4)]
    engine = StepwiseScripted(Scripted(tokenizer, scripts, prompts))
    start = time.perf_counter()
    outputs = loop.run(engine, prompts, [SamplingParams(max_new_tokens=100)] * 4)
    assert [o.finish_reason for o in outputs] == ["stop"] * 4
    # barrier: one engine call per turn for all samples; overlapped: one per sample and turn
    assert engine.engine.calls == (8 if overlap else 2)
    assert peak[0] == 3, "the 4 calls ran 3 at a time"
    assert time.perf_counter() - start < 0.75


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_turns=0"):
        AgentSettings({}, max_turns=0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        AgentSettings({}, timeout_s=0)
