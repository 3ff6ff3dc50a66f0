"""reduce_metrics: the step's loss means over the ranks; one-rank groups make no collective."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from mindspeed.testing.distributed import run_distributed


def _reduce(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from mindspeed_llm.training.steps import LM_LOSS, reduce_metrics

    calls: list[int] = []
    inner = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        # Every rank creates every group, in the same order (new_group is collective); each rank's
        # pipeline group holds only itself, the data-parallel group is the world.
        singles = [dist.new_group([r]) for r in range(world_size)]
        groups = SimpleNamespace(pp=singles[rank], dp_cp=dist.group.WORLD)
        # Each rank's microbatches: sums 1.5 + rank and 2.25, counts 3 and 4 tokens.
        outputs = [{LM_LOSS: torch.tensor([1.5 + rank, 3.0])}, {LM_LOSS: torch.tensor([2.25, 4.0])}]
        value = reduce_metrics(outputs, groups=groups)[LM_LOSS]
    finally:
        dist.all_reduce = inner
    return {"value": value, "collectives": len(calls)}


def test_one_rank_reduces_without_collectives() -> None:
    (out,) = run_distributed(_reduce, 1)
    assert out["collectives"] == 0
    assert out["value"] == ((1.5 + 2.25) / 7, 7)


def test_two_ranks_reduce_over_the_data_parallel_group_only() -> None:
    outs = run_distributed(_reduce, 2)
    for out in outs:
        assert out["collectives"] == 1
        assert out["value"] == ((1.5 + 2.25 + 2.5 + 2.25) / 14, 14)
