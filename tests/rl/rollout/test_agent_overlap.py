"""Overlapped agent loop on the real built-in engine: the same rollouts as the barrier, token for token.

The policy is a tiny Llama whose weights make it a stochastic automaton over a few tokens (each
of those tokens' embedding is a direction, the output layer maps it to the next tokens' logits;
the random attention and MLP layers, scaled down, make the probabilities depend on the context):
after the assistant header it writes a random number of filler dots, then either an answer
(``A<|im_end|>``) or a call ``<tool_call>{"name": "sleepy", "arguments": {"x": "<digit>"}}</tool_call>``
(the call's fixed text is one token each), so samples differ in their number of turns and in
the length of each turn. The ``sleepy`` tool sleeps and answers a function of ``x``
(deterministic). The barrier schedule and the overlapped one must give every sample the same
tokens, loss mask, conversation and finish reason, with the log-probs equal to 1e-5, and the
overlapped one must have decoded while a tool was running (the barrier never does).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from mindspeed_llm.engine import InferenceEngine, SamplingParams
from mindspeed_rl.rollout.agent import AgentLoop, AgentSettings
from mindspeed_rl.rollout.builtin import BuiltinRollout
from mindspeed_rl.tools import QWEN25_TOOLS_TEMPLATE, Tool

PIECE, TAIL = '{"name": "sleepy", "arguments": {"x": "', '"}}'
#: The calculator's call (``{"expression": "<digit>"}``), for a checkpoint the Ray workers load.
CALCULATOR_PIECE = '{"name": "calculator", "arguments": {"expression": "'


def automaton_tokenizer(piece: str = PIECE) -> Any:
    """Characters, Qwen2.5's special tokens and the call's two fixed pieces (each one token)."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", piece, TAIL]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate([*specials, *chars])}
    core = Tokenizer(BPE(vocab, [], unk_token="<unk>"))
    core.add_special_tokens(specials)
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<unk>")
    fast.chat_template = QWEN25_TOOLS_TEMPLATE
    return fast


def save_automaton(path: Any, piece: str = CALCULATOR_PIECE, seed: int = 0) -> None:
    """The automaton Llama (calling the calculator) as a Hugging Face directory with its tokenizer."""
    from transformers import GenerationConfig, LlamaForCausalLM

    tokenizer = automaton_tokenizer(piece)
    config, state = automaton_weights(tokenizer, seed, piece=piece)
    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=config.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)


def automaton_weights(
    tokenizer: Any, seed: int = 0, filler: float = 0.9, piece: str = PIECE
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The automaton Llama's transformers config and Hugging Face-named weights (see the module
    docstring); ``filler``: the logit of one more dot after a dot (against 0.5 for a call, 0 for
    the answer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = tokenizer.convert_tokens_to_ids
    newline, dot, answer = ids("\n"), ids("."), ids("A")
    digits = [ids(str(d)) for d in range(10)]
    call, piece, tail, close, eos = ids("<tool_call>"), ids(piece), ids(TAIL), ids("</tool_call>"), ids("<|im_end|>")
    # state token -> {next token: logit}; the unlisted tokens get -30
    rules = {
        newline: {dot: 1.0, call: 0.8, answer: 0.2},
        dot: {dot: filler, call: 0.5, answer: 0.0},
        call: {piece: 30.0},
        piece: {d: 1.0 for d in digits},
        **{d: {tail: 30.0} for d in digits},
        tail: {close: 30.0},
        answer: {eos: 30.0},
    }
    hidden = 64
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=eos,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] *= 0.3  # the context moves the logits a little, never the automaton's steps
    embed, head = state["model.embed_tokens.weight"], torch.zeros(config.vocab_size, hidden)
    for dim, (token, nexts) in enumerate(rules.items()):
        embed[token] = 0.0
        embed[token, dim] = 4.0
        head[:, dim] = -30.0 / 8  # the normed state is ~8 along its direction
        for target, logit in nexts.items():
            head[target, dim] = logit / 8
    state["lm_head.weight"] = head
    return config, state


def automaton_policy(tokenizer: Any, max_batch_size: int = 16, seed: int = 0, filler: float = 0.9) -> BuiltinRollout:
    """The built-in engine on the automaton Llama (see :func:`automaton_weights`)."""
    config, state = automaton_weights(tokenizer, seed, filler)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = InferenceEngine.from_config(
        config, torch.float32, max_batch_size, 4096, tokenizer=tokenizer, eos_token_ids=[eos], device="cpu"
    )
    engine.load_weights(state)
    return BuiltinRollout(engine, seed=seed)


def sleepy_tool(sleep_s: float, log: list[tuple[float, float]] | None = None) -> Tool:
    """A deterministic tool that takes ``sleep_s``; its run intervals go to ``log``."""
    lock = threading.Lock()

    def run(arguments: dict) -> str:
        start = time.perf_counter()
        time.sleep(sleep_s)
        if log is not None:
            with lock:
                log.append((start, time.perf_counter()))
        return str(int(arguments["x"]) * 7 % 10)

    schema = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    return Tool("sleepy", "Sleeps, then answers.", schema, run)


def rollout_inputs(loop: AgentLoop, tokenizer: Any, n: int, max_new_tokens: int = 24) -> tuple[list, list, list]:
    """``n`` prompts (4 distinct ones), each with its own seed."""
    conversations = [[{"role": "user", "content": f"q{i % 4}"}] for i in range(n)]
    prompts = [tokenizer(loop.prompt_text(c), add_special_tokens=False)["input_ids"] for c in conversations]
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=1000 + i) for i in range(n)]
    return prompts, params, conversations


def timed_steps(rollout: BuiltinRollout, log: list[tuple[float, float]]) -> None:
    """Record the interval of every engine step (generate call or session step) in ``log``."""
    generate, session = rollout.generate, rollout.session

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args)
            log.append((start, time.perf_counter()))
            return out

        return wrapper

    def open_session(slots: int, max_len: int) -> Any:
        s = session(slots, max_len)
        s.step = timed(s.step)
        return s

    rollout.generate, rollout.session = timed(generate), open_session


def test_overlapped_equals_barrier_on_the_engine() -> None:
    torch.set_num_threads(1)
    tokenizer = automaton_tokenizer()
    rollout = automaton_policy(tokenizer)
    runs = {}
    for overlap in (False, True):
        tool_log: list[tuple[float, float]] = []
        step_log: list[tuple[float, float]] = []
        settings = AgentSettings(
            {"sleepy": sleepy_tool(0.02, tool_log)}, max_turns=4, max_response_length=400, max_parallel=16
        )
        loop = AgentLoop(tokenizer, settings)
        prompts, params, conversations = rollout_inputs(loop, tokenizer, 16)
        engine = BuiltinRollout(rollout.engine)
        timed_steps(engine, step_log)
        loop.settings = AgentSettings(**{**settings.__dict__, "overlap": overlap})
        runs[overlap] = loop.run(engine, prompts, params, conversations)
        # a step "during" a tool run: it started after the tool started and before it ended
        during = sum(any(t0 < s0 < t1 for t0, t1 in tool_log) for s0, _ in step_log)
        if overlap:
            assert during > 0, "the overlapped loop decoded while a tool ran"
        else:
            assert during == 0, "the barrier never decodes while a tool runs"

    # The in-process trainer's engine (an InferenceEngine itself) takes the overlapped path too.
    engine = rollout.engine
    engine.generate = lambda *a, **k: pytest.fail("the overlapped loop never calls generate")
    try:
        runs["engine"] = loop.run(engine, prompts, params, conversations)
    finally:
        del engine.generate
    assert [o.token_ids for o in runs["engine"]] == [o.token_ids for o in runs[True]]

    barrier, overlapped = runs[False], runs[True]
    for i, (b, o) in enumerate(zip(barrier, overlapped)):
        assert o.token_ids == b.token_ids, i
        assert o.loss_mask == b.loss_mask and o.messages == b.messages, i
        assert (o.finish_reason, o.turns, o.tool_calls) == (b.finish_reason, b.turns, b.tool_calls), i
        assert max(abs(x - y) for x, y in zip(o.logprobs, b.logprobs)) < 1e-5
    # The rollouts are worth comparing: calls, several turn counts, a real answer after a tool.
    turns = [o.turns for o in barrier]
    assert sum(o.tool_calls for o in barrier) >= 8 and len(set(turns)) >= 3, turns
    assert all(not o.tool_errors for o in barrier), [dict(o.tool_errors) for o in barrier]
    assert any(o.finish_reason == "stop" and o.tool_calls for o in barrier)
    tool_answers = {m["content"] for o in barrier for m in o.messages if m["role"] == "tool"}
    assert len(tool_answers) >= 3, tool_answers  # the digits were sampled, the tool computed


@pytest.mark.parametrize("overlap", [False, True])
def test_unseeded_requests_are_refused_nowhere(overlap: bool) -> None:
    """Without seeds the engine seeds each request itself (the samples then differ between schedules)."""
    tokenizer = automaton_tokenizer()
    rollout = automaton_policy(tokenizer, max_batch_size=4)
    loop = AgentLoop(tokenizer, AgentSettings({"sleepy": sleepy_tool(0.0)}, max_turns=3, overlap=overlap))
    prompts, _, conversations = rollout_inputs(loop, tokenizer, 6)
    outputs = loop.run(rollout, prompts, [SamplingParams(max_new_tokens=24, temperature=1.0)] * 6, conversations)
    assert all(o.turns >= 1 and len(o.token_ids) == len(o.loss_mask) for o in outputs)
