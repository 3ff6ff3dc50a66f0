"""The critic inside the actor workers (co-located, as MindSpeed-RL places it), driven as one critic.

Each actor worker of a PPO run holds its shard of the critic next to its shard of the actor
(same process, same device, same TP/PP/DP layout): the critic is placed in the actor's resource
pool by construction. :class:`CriticView` gives the driver a :class:`~mindspeed_rl.models.critic.Critic`-like
``compute_values`` / ``update``, each data-parallel replica on its token-balanced share of the
pairs (the actor group's split), results back in the caller's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mindspeed_rl.workers.group import ActorGroup, Pair


class CriticView:
    """The critic of the actor workers, with a ``Critic``-like ``compute_values`` and ``update``."""

    def __init__(self, group: ActorGroup) -> None:
        self.group = group

    def compute_values(self, pairs: Sequence[Pair]) -> list[torch.Tensor]:
        """The value at every response token of every pair, in order."""
        g = self.group
        shares = g._split(pairs)
        results = g._run("compute_values", [([pairs[i] for i in share],) for share in shares])
        out: list[Any] = [None] * len(pairs)
        for dp_rank, share in enumerate(shares):
            for i, values in zip(share, results[g.readers[dp_rank]]):
                out[i] = values
        return out

    def update(
        self, pairs: Sequence[Pair], values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> dict[str, float]:
        """One critic step over all ``pairs``, each replica on its share (gradients all-reduced)."""
        g = self.group
        shares = g._split(pairs)
        args = []
        for share in shares:
            pick = torch.tensor(share, dtype=torch.long)
            mask = None if loss_mask is None else loss_mask[pick]
            args.append(([pairs[i] for i in share], values[pick], returns[pick], mask))
        return g.merge_metrics(g._run("update_critic", args))
