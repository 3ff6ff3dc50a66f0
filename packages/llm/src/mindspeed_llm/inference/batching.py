"""Continuous batching of the built-in inference engine: requests, admission, prefill, decode.

:class:`ContinuousBatching` is a part of :class:`~mindspeed_llm.inference.InferenceEngine` (its
``generate`` loop calls these steps): waiting requests are admitted while slots are free and
their prompts prefilled together (right-padded rows, causal attention, keys and values written
into their cache slots; requests with the same prompt share its prefill); every running
request then advances by one token in a batched decode step; a finished request frees its slot
and the last running one moves into it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed_llm.inference.cache import DecodeStep, KVCache, PrefillStep
from mindspeed_llm.inference.compiled import SampleSettings
from mindspeed_llm.inference.sampling import SamplingParams

logger = get_logger("mindspeed_llm.inference.engine")

Stream = Callable[[int, int], None]

#: Cache lengths are rounded up to a multiple of this (fewer reallocations across calls).
_CACHE_ROUND = 64

#: Sampling rows decoded in chunks (the token choice inside the compiled graph) at most; more take one step a
#: call with the sampler outside. Measured on the CPU (2026-12-03, one thread, vocabulary 2,048, temperature 1,
#: 64 new tokens): 8 rows 1.16x faster in chunks, 32 rows (GRPO's 4 prompts x 8) 0.45x (0.85 against 0.38 CPU s
#: a rollout): the in-graph noise and top-k/top-p over [rows, vocab] x 4 steps cost more than the calls saved.
SAMPLED_CHUNK_MAX_ROWS = 8


@dataclass
class Request:
    """One generation request: its prompt, sampling, stop ids, limit and what it produced so far."""

    index: int
    prompt: list[int]
    params: SamplingParams
    generator: int | None  # the sampler's noise key (None: greedy)
    stops: frozenset[int]
    limit: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def cached(self) -> int:
        """Positions holding keys in the cache (all but the newest token)."""
        return len(self.prompt) + len(self.tokens) - 1


class ContinuousBatching:
    """The engine's batching steps (reads its ``model``, ``sampler``, ``cache``, ``max_seq_len``,
    ``max_prefill_tokens`` and ``prefix_sharing``)."""

    model: Any
    sampler: Any
    cache: KVCache | None
    max_seq_len: int
    max_prefill_tokens: int
    prefix_sharing: bool
    compiled: Any

    def _ensure_cache(self, slots: int, length: int) -> None:
        length = min(self.max_seq_len, -(-length // _CACHE_ROUND) * _CACHE_ROUND)
        if self.cache is not None and self.cache.fits(slots, length, self.model.dtype):
            return
        if self.cache is not None:  # grow to cover both the old and the new need
            slots, length = max(slots, self.cache.num_slots), max(length, self.cache.max_len)
        spec = self.model.spec
        self.cache = None  # free the old one first
        self.cache = KVCache(
            spec.num_layers,
            slots,
            length,
            spec.num_kv_heads,
            spec.head_dim,
            spec.windows,
            self.model.dtype,
            self.model.device,
            self.model.recurrent_states(slots),
        )
        logger.debug("KV cache: %d slots x %d tokens, %.1f MB", slots, length, self.cache.nbytes / 1e6)

    def _admit(self, waiting: collections.deque, free: int) -> list[Request]:
        # The budget counts the prompts a prefill runs: with prefix sharing, distinct prompts only.
        admitted = [waiting.popleft()]
        longest, distinct = len(admitted[0].prompt), {tuple(admitted[0].prompt)}
        while waiting and len(admitted) < free:
            prompt = tuple(waiting[0].prompt)
            rows = len(distinct | {prompt}) if self.prefix_sharing else len(admitted) + 1
            if max(longest, len(prompt)) * rows > self.max_prefill_tokens:
                break
            longest = max(longest, len(prompt))
            distinct.add(prompt)
            admitted.append(waiting.popleft())
        if not self.prefix_sharing:
            return admitted
        # First occurrences first: they are prefilled into slots start .. start + distinct - 1.
        first: dict[tuple[int, ...], Request] = {}
        for request in admitted:
            first.setdefault(tuple(request.prompt), request)
        leaders = list(first.values())
        return leaders + [r for r in admitted if first[tuple(r.prompt)] is not r]

    def _prefill(self, requests: list[Request], start: int, stream: Stream | None) -> None:
        # ``requests`` come from :meth:`_admit`: with prefix sharing, each distinct prompt's first
        # request precedes every request that repeats it.
        model, device = self.model, self.model.device
        rows: dict[tuple[int, ...], int] = {}
        source = [
            rows.setdefault(tuple(r.prompt), len(rows)) if self.prefix_sharing else i for i, r in enumerate(requests)
        ]
        leaders = requests[: len(rows)] if self.prefix_sharing else requests
        lengths = [len(r.prompt) for r in leaders]
        seq = max(lengths)
        tokens = torch.zeros(len(leaders), seq, dtype=torch.long)
        for row, request in enumerate(leaders):
            tokens[row, : lengths[row]] = torch.tensor(request.prompt)
        positions = torch.arange(seq).repeat(len(leaders))
        step = PrefillStep(
            model.attention, model.spec.windows, model.scale, len(leaders), seq, self.cache, start, lengths
        )
        hidden = model.hidden(tokens.view(-1).to(device), positions.to(device), step)
        self.cache.close_rows(start, lengths)
        for row in range(len(leaders), len(requests)):  # the shared prompts' keys and values
            self.cache.move(start + source[row], start + row, lengths[source[row]])
        last = torch.tensor([row * seq + length - 1 for row, length in enumerate(lengths)], device=device)
        logits = model.logits(hidden[last])
        if len(leaders) < len(requests):
            logits = logits[torch.tensor(source, device=device)]
        self._advance(requests, logits, stream)

    def _decode(self, running: list[Request], stream: Stream | None) -> None:
        compiled = self.compiled
        if compiled is not None and compiled.chunk > 1 and not self.cache.window_layers:
            # Rows with room for a whole chunk: several steps, the token choice inside one graph call.
            sampled = not all(r.params.greedy for r in running)
            fits = len(running) <= SAMPLED_CHUNK_MAX_ROWS or not sampled
            if fits and all(r.limit - len(r.tokens) >= compiled.chunk for r in running):
                last, cached = [r.tokens[-1] for r in running], [r.cached for r in running]
                if not sampled:
                    chosen, logprobs = compiled.greedy_steps(self.cache, last, cached, compiled.chunk)
                else:
                    settings = SampleSettings(
                        [r.params for r in running],
                        [r.generator for r in running],
                        [len(r.tokens) for r in running],
                        self.model.device,
                    )
                    chosen, logprobs = compiled.sampled_steps(self.cache, last, cached, compiled.chunk, settings)
                for request, tokens, values in zip(running, chosen, logprobs):
                    for token, logprob in zip(tokens, values):
                        if self._append(request, token, logprob, stream):
                            break  # its later tokens are dropped
                return
        if compiled is not None:
            logits = self.compiled.logits(self.cache, [r.tokens[-1] for r in running], [r.cached for r in running])
            self._advance(running, logits, stream)
            return
        model, device = self.model, self.model.device
        tokens = torch.tensor([r.tokens[-1] for r in running], device=device)
        cached = [r.cached for r in running]
        positions = torch.tensor(cached, device=device)
        step = DecodeStep(model.attention, model.scale, self.cache, positions, max(cached) + 1)
        self._advance(running, model.logits(model.hidden(tokens, positions, step)), stream)

    def _advance(self, requests: list[Request], logits: torch.Tensor, stream: Stream | None) -> None:
        tokens, logprobs = self.sampler.sample(
            logits, [r.params for r in requests], [r.generator for r in requests], [len(r.tokens) for r in requests]
        )
        for request, token, logprob in zip(requests, tokens, logprobs):
            self._append(request, token, logprob, stream)

    @staticmethod
    def _append(request: Request, token: int, logprob: float, stream: Stream | None) -> bool:
        """Give ``request`` its next token; whether that finished it."""
        request.tokens.append(token)
        request.logprobs.append(logprob)
        if stream is not None:
            stream(request.index, token)
        if token in request.stops:
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.limit:
            request.finish_reason = "length"
        return request.finish_reason is not None

    def _retire(self, running: list[Request]) -> None:
        # Finished requests leave; the last running request moves into each hole, so the
        # running ones stay in slots 0 .. n-1 (a decode step attends over one plain slice).
        index = 0
        while index < len(running):
            if running[index].finish_reason is None:
                index += 1
                continue
            last = len(running) - 1
            if index != last:
                self.cache.move(last, index, running[last].cached)
                running[index] = running[last]
            running.pop()
