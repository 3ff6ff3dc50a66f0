"""Which samples each rank trains on at each step: a function of the step alone, so a resumed run continues exactly.

Step ``s`` (from 1) takes the global samples ``[(s - 1) G, s G)`` with ``G = micro x accumulation
x world`` of an endless stream of epochs (each a seeded permutation, or the file order without
``shuffle``). Inside a step the blocks of ``micro`` samples are laid out rank-major: rank ``r``'s
microbatch ``j`` is block ``r x accumulation + j``; so one rank with ``A x W`` microbatches sees
the same microbatches as ``W`` ranks with ``A`` each (the data-parallel parity the tests check).
"""

from __future__ import annotations

import torch


class SampleOrder:
    """Sample indices per (step, rank, microbatch).

    Args:
        num_samples: samples in the data set.
        micro: samples per microbatch.
        accumulation: microbatches per rank per step.
        world: data-parallel ranks.
        seed: seed of the permutations (epoch ``e`` uses ``seed + e``).
        shuffle: permute each epoch (else the file order).
    """

    def __init__(self, num_samples: int, micro: int, accumulation: int, world: int, seed: int, shuffle: bool) -> None:
        self.num_samples, self.micro, self.accumulation, self.world = num_samples, micro, accumulation, world
        self.seed, self.shuffle = seed, shuffle
        self._epochs: dict[int, list[int]] = {}

    def _epoch(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._epochs[epoch] = torch.randperm(self.num_samples, generator=gen).tolist()
            else:
                self._epochs[epoch] = list(range(self.num_samples))
            self._epochs.pop(epoch - 2, None)  # keep memory flat over long runs
        return self._epochs[epoch]

    def indices(self, step: int, rank: int, microbatch: int) -> list[int]:
        """Sample indices of ``rank``'s microbatch ``microbatch`` at step ``step`` (from 1)."""
        per_step = self.micro * self.accumulation * self.world
        start = (step - 1) * per_step + (rank * self.accumulation + microbatch) * self.micro
        return [self._epoch(k // self.num_samples)[k % self.num_samples] for k in range(start, start + self.micro)]
