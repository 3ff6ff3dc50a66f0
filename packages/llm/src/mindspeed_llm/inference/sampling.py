"""Choosing the next token: greedy, temperature, top-k, top-p, with one random stream per request.

Filtering follows transformers' logits warpers in their order (temperature, then top-k, then
top-p on what top-k left), batched over rows that may each have their own settings. Sampling
uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw from ``p``): each
request draws its ``E`` from its own generator, seeded from its ``seed``, exactly ``vocab``
numbers per token, so its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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


class Sampler:
    """Picks the next token of a batch of requests, each with its own settings and random stream.

    Args:
        device: where logits live (the generators are made there).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def generator(self, params: SamplingParams) -> torch.Generator | None:
        """The random stream of a new request (``None`` for greedy requests)."""
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
    ) -> tuple[list[int], list[float]]:
        """Next token of each row and its log-probability under the unmodified logits.

        Args:
            logits: ``[rows, vocab]`` fp32.
            params: settings of each row.
            generators: random stream of each row (``None`` for greedy rows).

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
            race = torch.empty_like(probs)
            for row, index in enumerate(sampled):
                race[row].exponential_(generator=generators[index])
            chosen[rows] = (probs / race).argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0]
        return chosen.tolist(), logprobs.tolist()
