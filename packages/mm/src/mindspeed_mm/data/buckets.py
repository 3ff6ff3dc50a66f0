"""Microbatches of one shape: a sample order that buckets cached samples by their latent shape.

A diffusion transformer's microbatch stacks its samples, so they must share one latent shape
(resolution and frame count), as MindSpeed-MM's ``group_data`` / bucketed samplers arrange. Epoch
``e`` walks a seeded permutation of the samples (``seed + e``; the file order without
``shuffle``) and drops each sample into the bucket of its shape; a bucket that holds
``micro`` samples becomes the next microbatch, so the microbatches follow the permutation and
mix shapes from one to the next. What is left in the buckets at the end of an epoch is not
trained that epoch.

Microbatches are numbered over the whole run and laid out as :class:`~mindspeed_mm.data.order.SampleOrder`
lays out its blocks: rank ``r``'s microbatch ``j`` of step ``s`` is number
``((s - 1) W + r) A + j``, so one rank with ``A x W`` microbatches sees what ``W`` ranks with
``A`` each see, and the order is a function of the step alone (resume continues exactly).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from mindspeed.log import get_logger

logger = get_logger(__name__)


class BucketOrder:
    """Sample indices per (step, rank, microbatch), every microbatch of one key.

    Args:
        keys: one hashable key per sample (its latent shape).
        micro: samples per microbatch.
        accumulation: microbatches per rank per step.
        world: data-parallel ranks.
        seed: seed of the permutations (epoch ``e`` uses ``seed + e``).
        shuffle: permute each epoch (else the file order).

    Raises:
        ValueError: no key has ``micro`` samples (naming the largest bucket and the fix).
    """

    def __init__(
        self, keys: Sequence[Hashable], micro: int, accumulation: int, world: int, seed: int, shuffle: bool
    ) -> None:
        self.keys, self.micro, self.accumulation, self.world = list(keys), micro, accumulation, world
        self.seed, self.shuffle = seed, shuffle
        sizes: dict[Hashable, int] = {}
        for key in self.keys:
            sizes[key] = sizes.get(key, 0) + 1
        self.per_epoch = sum(size // micro for size in sizes.values())
        if self.per_epoch == 0:
            largest = max(sizes.items(), key=lambda item: item[1])
            raise ValueError(
                f"train.micro_batch_size={micro}: no latent shape has that many samples (the largest "
                f"bucket, {largest[0]}, has {largest[1]}); lower train.micro_batch_size"
            )
        left = len(self.keys) - self.per_epoch * micro
        if left:
            logger.info(
                "buckets: %d shapes, %d microbatches of %d per epoch, %d samples left out per epoch",
                len(sizes),
                self.per_epoch,
                micro,
                left,
            )
        self._epochs: dict[int, list[list[int]]] = {}

    def _epoch(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            if self.shuffle:
                order = torch.randperm(len(self.keys), generator=torch.Generator().manual_seed(self.seed + epoch))
                order = order.tolist()
            else:
                order = list(range(len(self.keys)))
            buckets: dict[Hashable, list[int]] = {}
            microbatches = []
            for index in order:
                bucket = buckets.setdefault(self.keys[index], [])
                bucket.append(index)
                if len(bucket) == self.micro:
                    microbatches.append(bucket)
                    buckets[self.keys[index]] = []
            self._epochs[epoch] = microbatches
            self._epochs.pop(epoch - 2, None)  # keep memory flat over long runs
        return self._epochs[epoch]

    def number(self, step: int, rank: int, microbatch: int) -> int:
        """The run-wide number of ``rank``'s microbatch ``microbatch`` at step ``step`` (from 1)."""
        return ((step - 1) * self.world + rank) * self.accumulation + microbatch

    def indices(self, step: int, rank: int, microbatch: int) -> list[int]:
        """Sample indices of ``rank``'s microbatch ``microbatch`` at step ``step`` (from 1)."""
        k = self.number(step, rank, microbatch)
        return list(self._epoch(k // self.per_epoch)[k % self.per_epoch])
