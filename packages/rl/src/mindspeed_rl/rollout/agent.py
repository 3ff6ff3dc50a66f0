"""Multi-turn, tool-using rollouts over any engine's ``generate``: the agent loop.

One call of :meth:`AgentLoop.run` runs every sample turn by turn::

    generate (until </tool_call> closes, the end of the turn, or the turn's token limit)
      -> parse the calls of the generated turn only (the tools prompt holds <tool_call> examples)
      -> execute the calls (a thread pool)
      -> append the chat template's tokens for the results (end of the assistant turn, the tool
         messages, the next assistant header)
      -> generate again, until an answer, ``max_turns`` or ``max_response_length``

Two schedules give the same samples (a sample's turns depend on its own seed, advanced per
turn, and its tool results only):

- *overlapped* (:meth:`AgentLoop.generate_overlapped`, the built-in engine: an
  ``InferenceEngine`` or a ``BuiltinRollout``, in the process that runs the loop): one continuous batch for the whole rollout; a sample's calls go to the tool pool the
  step its turn closes, and its next turn joins the batch the moment its results are back,
  while the other samples go on decoding;
- *barrier* (:meth:`AgentLoop.generate`, any ``generate(prompt_ids, params)``: vLLM, or
  ``overlap`` off): per turn, one ``generate`` call for every unfinished sample, then the
  calls of all of them at once.

On Ray (an engine with ``agent_generate``: the co-located workers or a rollout pool), the loop
itself is shipped to the workers, each running it on its share with its own engine and tools.

The response of a sample is everything after its prompt: its generated tokens *and* the
appended ones. :attr:`AgentOutput.loss_mask` is 1 on the generated tokens and 0 on the appended
ones (the template's and the tools' text), which carry no loss and no advantage;
:attr:`AgentOutput.logprobs` holds the engine's log-probs of the generated tokens and 0 on the
appended ones. A malformed call, an unknown tool, a timeout or a tool's exception is a result
the model reads (``mindspeed_rl.tools``), never an exception here.

Each turn re-sends the whole context (the built-in engine prefills it again: no prefix cache
across turns).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mindspeed_llm.engine import GenerationOutput, GenerationSession, InferenceEngine, SamplingParams
from mindspeed_rl.tools import (
    Tool,
    ToolExecutor,
    ToolResult,
    execute_calls,
    parse_tool_calls,
    render_continuation,
    tool_messages,
    tool_schemas,
)
from mindspeed_rl.tools.parse import CLOSE

#: ``generate(prompt_ids, params) -> outputs`` with ``token_ids``, ``logprobs``, ``finish_reason``.
Generate = Callable[[list[list[int]], list[SamplingParams]], list[Any]]


class Session(Protocol):
    """Step-wise generation (:class:`mindspeed_llm.engine.GenerationSession`): requests join between steps."""

    @property
    def busy(self) -> bool: ...

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> int: ...

    def step(self) -> list[tuple[int, GenerationOutput]]: ...


#: ``open_session(slots, max_len) -> Session`` (:meth:`BuiltinRollout.session`).
OpenSession = Callable[[int, int], Session]


@dataclass(frozen=True)
class AgentSettings:
    """How the agent loop runs.

    Attributes:
        tools: the offered tools by name (:func:`mindspeed_rl.tools.build_tools`).
        max_turns: assistant turns per sample at most (a turn's calls after the last are not run).
        max_response_length: response tokens per sample at most, generated and appended together.
        max_parallel: tool calls run at once (across the samples).
        timeout_s: wall seconds per tool call.
        overlap: run tools while other samples generate where the engine allows it
            (:meth:`AgentLoop.run`); the samples are the same either way.
    """

    tools: Mapping[str, Tool]
    max_turns: int = 4
    max_response_length: int = 512
    max_parallel: int = 4
    timeout_s: float = 30.0
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_response_length < 1:
            raise ValueError(
                f"max_turns={self.max_turns}, max_response_length={self.max_response_length}: give positive values"
            )
        if self.max_parallel < 1 or not self.timeout_s > 0:
            raise ValueError(f"max_parallel={self.max_parallel}, timeout_s={self.timeout_s}: give positive values")


@dataclass
class AgentOutput:
    """One sample of a multi-turn rollout (a :class:`~mindspeed_llm.engine.GenerationOutput` and more).

    Attributes:
        prompt_token_ids: the prompt.
        token_ids: the response: generated and appended tokens, in order.
        logprobs: per response token, the engine's log-prob (0.0 on appended tokens).
        loss_mask: per response token, 1 if generated, 0 if appended.
        finish_reason: ``stop`` (an answer: a turn without calls), ``length``
            (``max_response_length``) or ``max_turns``.
        turns: assistant turns generated.
        tool_calls: calls made (malformed ones included).
        tool_errors: failed calls by kind (``malformed_call``, ``timeout``, ...).
        tool_time_s: wall seconds of its calls (summed).
        messages: the conversation after the prompt (assistant and tool messages).
    """

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Counter[str] = field(default_factory=Counter)
    tool_time_s: float = 0.0
    messages: list[dict[str, str]] = field(default_factory=list)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Generated tokens (with their log-probs, mask 1) or appended ones (``logprobs`` None, mask 0)."""
        self.token_ids.extend(int(t) for t in ids)
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs])
        self.loss_mask.extend([0 if logprobs is None else 1] * len(ids))


class AgentLoop:
    """The agent loop of one tokenizer and tool set (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer whose chat template renders ``tool`` messages.
        settings: tools and limits.
    """

    def __init__(self, tokenizer: Any, settings: AgentSettings) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self.schemas = tool_schemas(settings.tools)
        close = tokenizer.convert_tokens_to_ids(CLOSE) if CLOSE in tokenizer.get_vocab() else None
        # </tool_call> as one token stops the turn where the call closes; otherwise the turn
        # runs to its end-of-turn token, and every call of it is run.
        self.close_id: int | None = close
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}

    def run(
        self,
        engine: Any,
        prompt_ids: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    ) -> list[AgentOutput]:
        """The multi-turn responses on ``engine``: overlapped where it has a ``session`` or is an
        :class:`~mindspeed_llm.engine.InferenceEngine` (and ``settings.overlap``), else with a
        barrier per turn over its ``generate``. Same samples either way."""
        remote = getattr(engine, "agent_generate", None)
        if self.settings.overlap and callable(remote):  # Ray rollout workers: the loop runs in each worker
            return remote(self, prompt_ids, params, self._start(prompt_ids, params, messages)[1])
        open_session = getattr(engine, "session", None)
        if isinstance(engine, InferenceEngine):  # the in-process trainer's engine itself

            def open_session(slots: int, max_len: int) -> Session:
                return GenerationSession(engine, slots, max_len)

        if self.settings.overlap and callable(open_session):
            return self.generate_overlapped(open_session, prompt_ids, params, messages)
        return self.generate(engine.generate, prompt_ids, params, messages)

    def generate(
        self,
        generate: Generate,
        prompt_ids: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    ) -> list[AgentOutput]:
        """The multi-turn responses of ``prompt_ids``, one ``generate`` call per turn (a barrier).

        Args:
            generate: the engine's ``generate``.
            prompt_ids: each prompt's ids (rendered with the tools, see :meth:`prompt_text`).
            params: per prompt; ``max_new_tokens`` bounds each turn, the seed (if any) is
                advanced per turn.
            messages: each prompt's conversation (default: one empty user turn; the tool results
                are rendered after it, which is what any template that renders each message on
                its own gives).

        Returns:
            One :class:`AgentOutput` per prompt, in order.
        """
        outputs, base = self._start(prompt_ids, params, messages)
        active = list(range(len(prompt_ids)))
        while active:
            requests = [self._turn_params(params[i], outputs[i]) for i in active]
            results = generate([outputs[i].prompt_token_ids + outputs[i].token_ids for i in active], requests)
            calling = []
            for i, result in zip(active, results):
                closed = self._close_turn(outputs[i], result)
                if closed is not None:
                    calling.append((i, *closed))
            flat = [call for _, _, calls in calling for call in calls]
            done = execute_calls(flat, self.settings.tools, self.settings.max_parallel, self.settings.timeout_s)
            active, first = [], 0
            for i, text, calls in calling:
                mine, first = done[first : first + len(calls)], first + len(calls)
                if self._continue(outputs[i], base[i], text, mine):
                    active.append(i)
        return outputs

    def generate_overlapped(
        self,
        open_session: OpenSession,
        prompt_ids: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    ) -> list[AgentOutput]:
        """:meth:`generate` with tool calls overlapped with the other samples' generation.

        One session (continuous batch) serves every turn: between two engine steps, the samples
        whose turn closed send their calls to the tool pool and the samples whose results came
        back are appended to and rejoin the batch. When no sample is decoding, the loop waits for
        the next result. A sample's turns are those :meth:`generate` gives it (same seeds, same
        contexts); only the order in which samples are served differs.

        Args:
            open_session: ``open_session(slots, max_len)`` of the engine (``BuiltinRollout.session``).
            prompt_ids, params, messages: as in :meth:`generate`.
        """
        outputs, base = self._start(prompt_ids, params, messages)
        if not outputs:
            return outputs
        longest = max(len(p) for p in prompt_ids) + self.settings.max_response_length
        session = open_session(len(prompt_ids), longest)
        sample_of: dict[int, int] = {}  # session request -> sample
        closed: dict[int, tuple[int, str]] = {}  # tool batch -> (sample, its turn's text)

        def submit(i: int) -> None:
            out = outputs[i]
            sample_of[session.submit(out.prompt_token_ids + out.token_ids, self._turn_params(params[i], out))] = i

        for i in range(len(outputs)):
            submit(i)
        with ToolExecutor(self.settings.tools, self.settings.max_parallel, self.settings.timeout_s) as executor:
            while session.busy or executor.busy:
                for request, result in session.step() if session.busy else []:
                    i = sample_of.pop(request)
                    turn = self._close_turn(outputs[i], result)
                    if turn is not None:
                        closed[executor.submit(turn[1])] = (i, turn[0])
                # Block for a result only when nothing decodes.
                for batch, results in executor.poll(wait_s=0.0 if session.busy else 0.05):
                    i, text = closed.pop(batch)
                    if self._continue(outputs[i], base[i], text, results):
                        submit(i)
        return outputs

    def _start(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        messages: Sequence[Sequence[Mapping[str, Any]]] | None,
    ) -> tuple[list[AgentOutput], list[list[Any]]]:
        if len(params) != len(prompt_ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_ids)} prompts; pass one per prompt")
        start = (
            [list(m) for m in messages]
            if messages is not None
            else [[{"role": "user", "content": ""}] for _ in prompt_ids]
        )
        return [AgentOutput(list(map(int, p))) for p in prompt_ids], start

    def _close_turn(self, out: AgentOutput, result: Any) -> tuple[str, list[Any]] | None:
        """Append a generated turn; its text and calls when they are to run, else None (the sample is done)."""
        out.append(result.token_ids, result.logprobs)
        out.turns += 1
        text = self._turn_text(result.token_ids)
        calls = parse_tool_calls(text)  # the generated turn only
        if not calls:
            out.finish_reason = "stop" if result.finish_reason == "stop" else "length"
        elif len(out.token_ids) >= self.settings.max_response_length:
            out.finish_reason = "length"
        elif out.turns >= self.settings.max_turns:
            out.finish_reason = "max_turns"
        else:
            return text, calls
        out.messages.append({"role": "assistant", "content": text})
        return None

    def prompt_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt of a conversation with the tools rendered in (the chat template's ``tools=``)."""
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.schemas, tokenize=False, add_generation_prompt=True
        )

    def _turn_params(self, params: SamplingParams, out: AgentOutput) -> SamplingParams:
        turn = out.turns  # the seed of a sample's k-th turn is its own, whoever else is generating
        room = self.settings.max_response_length - len(out.token_ids)
        stops = params.stop_token_ids + ((self.close_id,) if self.close_id is not None else ())
        return dataclasses.replace(
            params,
            max_new_tokens=max(1, min(params.max_new_tokens, room)),
            stop_token_ids=stops,
            seed=None if params.seed is None else params.seed + turn * 1_000_003,
        )

    def _turn_text(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        while ids and ids[-1] in self.eos_ids:  # the end-of-turn token is the template's, not the content
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _continue(self, out: AgentOutput, base: list[Any], text: str, results: Sequence[ToolResult]) -> bool:
        """Append a turn's tool results as the template renders them; whether the sample goes on."""
        self._count(out, results)
        ended_by_eos = out.token_ids[-1] in self.eos_ids
        assistant = {"role": "assistant", "content": text}
        conversation = [*base, *out.messages, assistant]
        appended = self._closing(conversation, text, ended_by_eos)
        appended += render_continuation(self.tokenizer, conversation, tool_messages(results), self.schemas)
        out.messages.extend([assistant, *tool_messages(results)])
        ids = self.tokenizer(appended, add_special_tokens=False)["input_ids"]
        room = self.settings.max_response_length - len(out.token_ids)
        out.append(ids[:room], None)
        if len(ids) >= room:  # no room left to answer in
            out.finish_reason = "length"
            return False
        return True

    def _closing(self, conversation: list[Mapping[str, Any]], text: str, ended_by_eos: bool) -> str:
        """The template's text after the assistant's content (``<|im_end|>\\n``), less an end-of-turn
        token the model generated itself."""
        rendered = self.tokenizer.apply_chat_template(conversation, tools=self.schemas, tokenize=False)
        at = rendered.rfind(text) if text else len(rendered)
        closing = rendered[at + len(text) :] if at >= 0 else ""
        eos = self.tokenizer.eos_token or ""
        if ended_by_eos and eos and closing.startswith(eos):
            closing = closing[len(eos) :]
        return closing

    @staticmethod
    def _count(out: AgentOutput, results: Sequence[ToolResult]) -> None:
        out.tool_calls += len(results)
        out.tool_time_s += sum(r.elapsed_s for r in results)
        out.tool_errors.update(r.error for r in results if r.error is not None)


def agent_metrics(outputs: Sequence[AgentOutput]) -> dict[str, float]:
    """A rollout's tool metrics: per sample means of turns, calls and tool seconds; errors by kind.

    ``tools/turns``, ``tools/calls`` (per sample), ``tools/call_rate`` (share of samples with a
    call), ``tools/errors`` (failed calls per call) and ``tools/errors/<kind>`` (per call),
    ``tools/time_s`` (tool seconds per sample, summed over its calls), ``tools/max_turns_rate``
    (share of samples stopped by ``max_turns``).
    """
    n = max(len(outputs), 1)
    calls = sum(o.tool_calls for o in outputs)
    errors: Counter[str] = Counter()
    for o in outputs:
        errors.update(o.tool_errors)
    record = {
        "tools/turns": sum(o.turns for o in outputs) / n,
        "tools/calls": calls / n,
        "tools/call_rate": sum(o.tool_calls > 0 for o in outputs) / n,
        "tools/errors": sum(errors.values()) / max(calls, 1),
        "tools/time_s": sum(o.tool_time_s for o in outputs) / n,
        "tools/max_turns_rate": sum(o.finish_reason == "max_turns" for o in outputs) / n,
    }
    record.update({f"tools/errors/{kind}": count / max(calls, 1) for kind, count in sorted(errors.items())})
    return record
