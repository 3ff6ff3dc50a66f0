"""``--reuse-fp32-param``: bf16 training without a resident fp32 master copy.

Mixed-precision training keeps every parameter twice: the bf16 weight the model computes with
(2 bytes) and the fp32 master the optimizer updates (4 bytes). The bf16 weight is the master
rounded to nearest-even, so it already holds the master's upper 16 bits up to the rounding;
what is missing is a 16-bit remainder. Between steps only the remainder is kept (2 bytes), and
the master is rebuilt exactly at the step: 4 bytes per parameter instead of 6, 2 saved (per
data-parallel shard with the distributed optimizer).

Bits. With ``F`` the master's bits as int32 and ``B`` the bf16 bits (``F`` rounded to
nearest-even, the cast megatron does), ``R = F - (B << 16)`` lies in ``[-32768, 32768]``:
65,537 values, one more than 16 bits hold. Round-to-nearest-even cannot be inverted from 16
bits alone (an even ``B`` has 65,537 fp32 values rounding to it; MindSpeed rounds ties away
from zero instead, so its bf16 weights differ from a plain cast on ties). Here the weights are
exactly megatron's: ``R`` is stored as int16 with ``+32768`` wrapped to ``-32768``, and the
positions where ``R`` is ``+32768`` (a tie rounded down: about one parameter in 65,536 per
step) are kept in a short index list. The master comes back bit for bit.

The step runs chunk by chunk (:class:`~mindspeed.memory.optimizer_step.ChunkedStep`, one
parameter per chunk by default): rebuild the chunk's masters, step, cast to bf16, keep the new
remainders, free the masters. So the step itself holds one parameter's master at a time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed.memory.optimizer_step import (
    ChunkedStep,
    MasterPair,
    master_pairs,
    materialize_before_state_methods,
    split_chunks,
    sub_optimizers,
)
from mindspeed.metrics.memory import resize_storage

logger = get_logger(__name__)

_TIE = 32768  # R = +32768: a tie rounded down, the one value int16 cannot hold


def split_fp32(master: torch.Tensor, bf16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The remainder of ``master`` over its round-to-nearest-even ``bf16`` copy.

    Args:
        master: fp32 values (any shape, contiguous).
        bf16: ``master.to(torch.bfloat16)``, same number of elements.

    Returns:
        ``(remainder, ties)``: int16 remainders (shape of ``master``) and the flat int64
        indices whose remainder is ``+32768`` (stored as ``-32768``).
    """
    if sys.byteorder == "little":
        # ``bf16 << 16`` has zero low bits, so R's int16 bits are the master's low half-word (R =
        # +32768 wraps to -32768 as stored): one strided copy. A low half of 0x8000 is a tie, rounded
        # down (R = +32768: the bf16 is the master's high half) or up (R = -32768: it is one more).
        halves = master.reshape(-1).view(torch.int16).view(-1, 2)
        remainder = halves[:, 0].clone()
        candidates = (remainder == -_TIE).nonzero().view(-1)
        if candidates.numel():
            candidates = candidates[bf16.reshape(-1).view(torch.int16)[candidates] == halves[candidates, 1]]
        return remainder.view(master.shape), candidates
    rest = bf16.reshape(-1).view(torch.int16).to(torch.int32)
    rest.bitwise_left_shift_(16)
    torch.sub(master.reshape(-1).view(torch.int32), rest, out=rest)
    ties = (rest == _TIE).nonzero().view(-1)
    rest[ties] = -_TIE
    return rest.to(torch.int16).view(master.shape), ties


def merge_fp32(bf16: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rebuild the fp32 master into ``out`` from its bf16 copy, remainder and ties (inverse of :func:`split_fp32`)."""
    # Built in ``out``'s own bits, with no temporary: widen (sign-extending), shift, add.
    bits = out.reshape(-1).view(torch.int32)
    bits.copy_(bf16.reshape(-1).view(torch.int16))
    bits.bitwise_left_shift_(16)
    bits.add_(remainder.reshape(-1))
    if ties.numel():
        bits[ties] += 2 * _TIE
    return out


@dataclass
class _Remainder:
    remainder: torch.Tensor
    ties: torch.Tensor


@dataclass
class ReuseFp32Param:
    """A ``post_optimizer_build`` hook: keep megatron's fp32 masters as 16-bit remainders between steps.

    Attributes:
        times: step the parameters in this many chunks (``None``: one parameter per chunk, so
            the step holds one rebuilt master at a time).
        steps: the chunked step of each megatron optimizer, after :meth:`install`.
        ties: tie positions seen (remainder ``+32768``) summed over the steps, for tests.
    """

    times: int | None = None
    steps: list[ChunkedStep] = field(default_factory=list)
    ties: int = 0
    _kept: dict[int, _Remainder] = field(default_factory=dict)

    def install(self, optimizer: Any) -> Any:
        """Free the masters of ``optimizer`` (megatron's bf16 optimizer) and step through remainders.

        Returns:
            ``optimizer`` itself (changed in place).

        Raises:
            ValueError: the optimizer has fp32 parameters of the model (fp32 training, or
                parameters kept in fp32): there is no bf16 weight to rebuild them from.
        """
        for sub in sub_optimizers(optimizer):
            pairs = master_pairs(sub)
            fp32 = [pair for pair in pairs if pair.model is None]
            if fp32:
                raise ValueError(
                    f"reuse_fp32_param: {len(fp32)} trained parameters are fp32 in the model, with no "
                    "bf16 weight to rebuild a master from; train in bf16 (train.precision=bf16) or turn "
                    "the feature off"
                )
            for pair in pairs:
                self._release(pair)
            self.steps.append(ChunkedStep(sub, split_chunks(pairs, self.times), self._rebuild_all, self._release_all))
            materialize_before_state_methods(sub, self.materialize)
        logger.info(
            "reuse_fp32_param: %d masters kept as bf16 + int16 remainders",
            sum(len(p) for s in self.steps for p in s.chunks),
        )
        return optimizer

    def materialize(self) -> None:
        """Rebuild every master; they stay until the next step (checkpoints read and write them)."""
        for step in self.steps:
            for chunk in step.chunks:
                self._rebuild_all(chunk)

    def _release(self, pair: MasterPair) -> None:
        with torch.no_grad():
            pair.model.copy_(pair.main.view(pair.model.shape))  # the weights equal the cast master
            remainder, ties = split_fp32(pair.main.detach(), pair.model)
        self.ties += int(ties.numel())
        self._kept[id(pair.main)] = _Remainder(remainder, ties)
        resize_storage(pair.main, 0)

    def _rebuild(self, pair: MasterPair) -> None:
        kept = self._kept.pop(id(pair.main), None)
        if kept is None:  # resident already (materialized for a checkpoint)
            return
        resize_storage(pair.main, pair.main.numel() * pair.main.element_size())
        with torch.no_grad():
            merge_fp32(pair.model, kept.remainder, kept.ties, pair.main.detach())

    def _rebuild_all(self, chunk: list[MasterPair]) -> None:
        for pair in chunk:
            self._rebuild(pair)

    def _release_all(self, chunk: list[MasterPair]) -> None:
        for pair in chunk:
            self._release(pair)

    def masters(self) -> list[torch.Tensor]:
        """Every master rebuilt as a new fp32 tensor, in optimizer order (for checks; the state is unchanged)."""
        out = []
        for step in self.steps:
            for chunk in step.chunks:
                for pair in chunk:
                    kept = self._kept.get(id(pair.main))
                    if kept is None:
                        out.append(pair.main.detach().clone())
                        continue
                    target = torch.empty(pair.main.shape, dtype=torch.float32, device=pair.model.device)
                    out.append(merge_fp32(pair.model, kept.remainder, kept.ties, target))
        return out
