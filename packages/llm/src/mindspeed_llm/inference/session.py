"""A generation session: requests submitted at any time to the engine's running continuous batch.

:meth:`InferenceEngine.generate <mindspeed_llm.inference.InferenceEngine.generate>` takes every
request up front and returns when the last one is done. A :class:`GenerationSession` runs the
same loop one iteration per :meth:`~GenerationSession.step` (admit and prefill waiting requests
while slots are free, one batched decode step, retire finished requests) and takes new requests
between steps, so a caller can start a request's follow-up (a multi-turn rollout's next turn,
after its tool call came back) while the others still decode. A request's tokens and log-probs
are those :meth:`generate` gives it: the sampling noise is a function of its seed and position
only (:mod:`.sampling`), and the steps are the engine's own.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from mindspeed.device.cuda_shim import redirect_suspended
from mindspeed_llm.inference.batching import ContinuousBatching, Request
from mindspeed_llm.inference.engine import GenerationOutput
from mindspeed_llm.inference.sampling import SamplingParams


class GenerationSession:
    """Step-wise continuous batching over an engine's KV cache.

    The cache is allocated once, for ``slots`` requests of ``max_len`` positions (it cannot grow
    under running requests); a request that needs more is refused at :meth:`submit`. Use one
    session at a time and no other call of the engine that generates while it has requests.

    Args:
        engine: an :class:`~mindspeed_llm.inference.InferenceEngine`.
        slots: requests decoded at once (at most the engine's ``max_batch_size``).
        max_len: prompt plus generated tokens of any request (at most the engine's ``max_seq_len``).
    """

    def __init__(self, engine: ContinuousBatching, slots: int, max_len: int) -> None:
        if slots < 1 or max_len < 2:
            raise ValueError(f"slots={slots}, max_len={max_len}: give at least 1 slot and 2 positions")
        self.engine = engine
        engine._ensure_cache(min(slots, engine.max_batch_size), min(max_len, engine.max_seq_len))
        self.cache = engine.cache
        self.slots = min(engine.max_batch_size, self.cache.num_slots)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._submitted = 0

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; it is admitted at a later :meth:`step`. Returns its id (0, 1, ... in order).

        Raises:
            ValueError: a prompt the engine rejects, or one that needs more cache positions than
                the session holds.
        """
        request = self.engine._request(self._submitted, prompt, params)
        need = len(request.prompt) + request.limit - 1
        if need > self.cache.max_len:
            raise ValueError(
                f"request {self._submitted} needs {need} cache positions, the session holds "
                f"{self.cache.max_len}; open the session with a larger max_len"
            )
        self.waiting.append(request)
        self._submitted += 1
        return request.index

    def step(self) -> list[tuple[int, GenerationOutput]]:
        """One iteration of the engine's loop; the requests it finished, as ``(id, output)``."""
        if self.engine.cache is not self.cache:
            raise RuntimeError("the engine's KV cache changed under an open session (another generate call?)")
        finished: list[Request] = []
        with redirect_suspended(), torch.inference_mode():
            if self.waiting and len(self.running) < self.slots:
                admitted = self.engine._admit(self.waiting, self.slots - len(self.running))
                self.engine._prefill(admitted, start=len(self.running), stream=None)
                self.running += admitted
                finished += self._retire()
            if self.running:
                self.engine._decode(self.running, None)
                finished += self._retire()
        return [
            (r.index, GenerationOutput(list(r.prompt), r.tokens, r.logprobs, r.finish_reason or "length"))
            for r in finished
        ]

    def _retire(self) -> list[Request]:
        done = [r for r in self.running if r.finish_reason is not None]
        if done:
            self.engine._retire(self.running)
        return done
