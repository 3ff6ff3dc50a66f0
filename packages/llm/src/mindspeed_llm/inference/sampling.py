"""Choosing the next token: greedy, temperature, top-k, top-p, with one random stream per request.

Filtering follows transformers' logits warpers in their order (temperature, then top-k, then
top-p on what top-k left), batched over rows that may each have their own settings. Sampling
uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw from ``p``). The
noise is counter-based: ``E`` of vocabulary entry ``v`` at a request's ``t``-th token is a hash of
(the request's key, ``t``, ``v``) (:func:`exponential_noise`), so the noise of every sampled row
of a step comes from one batched call (one ``exponential_`` per request and generator cost about
10 % of a decode step on the CPU), and a request's tokens depend only on its seed, never on
which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in ``[0, 2**32)``.

    Products of two 32-bit numbers fit in int64, so the arithmetic never overflows.
    """
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def request_key(seed: int) -> int:
    """The 32-bit noise key of a request seed (any int; all 64 bits take part)."""
    seed &= (1 << 64) - 1
    low = torch.tensor(seed & _MASK32, dtype=torch.int64)
    high = torch.tensor((seed >> 32) ^ 0x2545F491, dtype=torch.int64)
    return int(_mix32(_mix32(high) ^ low))


def exponential_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """``Exp(1)`` noise ``[rows, vocab]`` (float64) of requests with ``keys`` at their ``steps``-th token.

    Counter-based: entry ``[r, v]`` depends only on ``(keys[r], steps[r], v)``, so one call for a
    batch gives exactly what one call per request would.

    Args:
        keys: ``[rows]`` int64 request keys (:func:`request_key`).
        steps: ``[rows]`` int64 tokens each request has drawn so far.
        vocab: vocabulary size.
    """
    row = _mix32(keys ^ _mix32((steps * 0x9E3779B9 + 0x7F4A7C15) & _MASK32))
    column = (torch.arange(vocab, dtype=torch.int64, device=keys.device) * 0x85EBCA6B + 0xC2B2AE35) & _MASK32
    bits = _mix32(row[:, None] ^ column)
    # (bits + 0.5) / 2**32 is uniform on (0, 1), never 0 or 1.
    return -torch.log((bits.double() + 0.5) * 2.0**-32)


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request.

    Attributes:
        max_new_tokens: tokens to generate at most.
        temperature: 0 for greedy decoding; otherwise logits are divided by it before sampling.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches p (1: all).
        stop_token_ids: more ids that end the sequence (the model's end-of-sequence ids always do,
            unless ``ignore_eos``); the stop token is part of the output.
        seed: seed of the request's random stream (``None``: a fresh seed from torch's global
            generator, so ``torch.manual_seed`` makes runs repeatable).
        ignore_eos: do not stop at the model's end-of-sequence ids (``stop_token_ids`` still stop).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Temperature 0: the most likely token every time."""
        return self.temperature == 0.0


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Temperature, top-k and top-p applied row by row, as transformers' warpers do.

    Args:
        logits: ``[rows, vocab]`` fp32.
        temperature: ``[rows]`` (> 0).
        top_k: ``[rows]`` int, 0 = off.
        top_p: ``[rows]``, 1 = off.

    Returns:
        ``[rows, vocab]`` scaled logits with removed tokens at ``-inf``.
    """
    scores = logits / temperature[:, None]
    vocab = scores.shape[-1]
    if bool((top_k > 0).any()):
        # Ties with the k-th largest value survive (transformers' TopKLogitsWarper does the same).
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = torch.sort(scores, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if bool((top_p < 1).any()):
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = (cumulative <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]
        remove[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return scores


def sample_static(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Sampler.sample` without data-dependent branches or host reads (what a compiled graph can hold).

    Every row goes through temperature, top-k and top-p (a row without them has temperature 1, top-k
    0 and top-p 1, which change nothing: the same ops :func:`filter_logits` skips when no row uses
    them) and the exponential race; greedy rows then take the argmax. Per row the result is the
    eager sampler's.

    Args:
        logits: ``[rows, vocab]`` fp32.
        sampled: ``[rows]`` bool, False for greedy rows.
        temperature: ``[rows]`` (> 0; greedy rows: 1).
        top_k: ``[rows]`` int64, 0 = off.
        top_p: ``[rows]``, 1 = off.
        keys: ``[rows]`` int64 noise keys (greedy rows: any).
        steps: ``[rows]`` int64 tokens each request has drawn before.

    Returns:
        ``(tokens, logprobs)``: ``[rows]`` int64 and the log-probability of each under the unmodified logits.
    """
    scores = logits / temperature[:, None]
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = torch.sort(scores, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    scores = scores.masked_fill(scores < kth, float("-inf"))
    ascending, order = torch.sort(scores, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove = (cumulative <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]
    remove[:, -1] = False
    scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    race = exponential_noise(keys, steps, vocab)
    drawn = (scores.softmax(dim=-1).double() / race).argmax(dim=-1)
    tokens = torch.where(sampled, drawn, logits.argmax(dim=-1))
    return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]


class Sampler:
    """Picks the next token of a batch of requests, each with its own settings and random stream.

    Args:
        device: where logits live (the generators are made there).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def generator(self, params: SamplingParams) -> int | None:
        """The noise key of a new request (:func:`request_key` of its seed; ``None`` for greedy requests).

        A request without a seed takes a fresh one from torch's global generator, so
        ``torch.manual_seed`` makes runs repeatable.
        """
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        return request_key(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[int | None],
        steps: Sequence[int] | None = None,
    ) -> tuple[list[int], list[float]]:
        """Next token of each row and its log-probability under the unmodified logits.

        Args:
            logits: ``[rows, vocab]`` fp32.
            params: settings of each row.
            generators: noise key of each row (:meth:`generator`; ``None`` for greedy rows).
            steps: tokens each row's request has drawn before (the noise counter; default 0 each).

        Returns:
            ``(tokens, logprobs)``, one per row.
        """
        chosen = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            settings = [params[i] for i in sampled]
            temperature = torch.tensor([p.temperature for p in settings], device=logits.device)
            top_k = torch.tensor([p.top_k for p in settings], device=logits.device)
            top_p = torch.tensor([p.top_p for p in settings], device=logits.device)
            probs = filter_logits(logits[rows], temperature, top_k, top_p).softmax(dim=-1)
            keys = torch.tensor([generators[i] for i in sampled], dtype=torch.int64, device=logits.device)
            counters = torch.tensor(
                [steps[i] if steps else 0 for i in sampled], dtype=torch.int64, device=logits.device
            )
            race = exponential_noise(keys, counters, probs.shape[-1])
            chosen[rows] = (probs.double() / race).argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0]
        return chosen.tolist(), logprobs.tolist()
