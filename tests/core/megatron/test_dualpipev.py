"""DualPipeV's plan (:func:`mindspeed.megatron.dualpipev.dualpipev_plan`) and its feature's checks.

The plan of every rank is simulated together, as the schedule runs it: sends never block, a
receive waits for its message, messages of one kind between two ranks arrive in order. For
every pipeline size 2..8 and microbatch count 2P..2P+5 the simulation must finish (no
deadlock), every message must carry the microbatch its receiver expects, each chunk must run
its microbatches' forwards and backwards in order and a backward only after its forward. The
numbers of the schedule (losses, gradients, checkpoints) are proven in
``tests/llm/training/test_dualpipev.py``.
"""

from __future__ import annotations

from collections import deque

import pytest

from mindspeed.features import FEATURES, BuildContext, FeaturesConfig, ModelFacts, ParallelSizes, apply_features
from mindspeed.megatron.dualpipev import dualpipev_chunks, dualpipev_plan


def _sends(rank: int, last: int, kind: str, chunk: int) -> tuple | None:
    """Where the output of an op goes: (from, to, message kind); ``None``: nowhere (the loss, the input)."""
    if kind == "F":
        if chunk == 0:
            return (rank, rank, "turn") if rank == last else (rank, rank + 1, "act0")
        return None if rank == 0 else (rank, rank - 1, "act1")
    if chunk == 1:
        return (rank, rank, "turn-grad") if rank == last else (rank, rank + 1, "grad1")
    return None if rank == 0 else (rank, rank - 1, "grad0")


def _receives(rank: int, last: int, kind: str, chunk: int) -> tuple | None:
    if kind == "F":
        if chunk == 0:
            return None if rank == 0 else (rank - 1, rank, "act0")
        return (rank, rank, "turn") if rank == last else (rank + 1, rank, "act1")
    if chunk == 1:
        return None if rank == 0 else (rank - 1, rank, "grad1")
    return (rank, rank, "turn-grad") if rank == last else (rank + 1, rank, "grad0")


def simulate(num_ranks: int, num_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Run every rank's plan; returns each rank's (kind, chunk, microbatch) in execution order."""
    last = num_ranks - 1
    todo = []
    for rank in range(num_ranks):
        ops: deque = deque()
        for op in dualpipev_plan(rank, num_ranks, num_microbatches):
            ops.extend([("F", op[1]), ("B", op[2])] if op[0] == "FB" else [op])
        todo.append(ops)
    channels: dict[tuple, deque] = {}
    done: list[dict[tuple[str, int], int]] = [{} for _ in range(num_ranks)]
    trace: list[list[tuple[str, int, int]]] = [[] for _ in range(num_ranks)]
    while any(todo):
        progressed = False
        for rank, ops in enumerate(todo):
            while ops:
                kind, chunk = ops[0]
                micro = done[rank].get((kind, chunk), 0)
                source = _receives(rank, last, kind, chunk)
                if source is not None:
                    queue = channels.setdefault(source, deque())
                    if not queue:
                        break  # blocked on a receive
                    assert queue.popleft() == micro, f"rank {rank} {kind}{chunk}: another microbatch's message"
                if kind == "B":
                    assert micro < done[rank].get(("F", chunk), 0), f"rank {rank}: B{chunk} before its forward"
                ops.popleft()
                done[rank][(kind, chunk)] = micro + 1
                trace[rank].append((kind, chunk, micro))
                target = _sends(rank, last, kind, chunk)
                if target is not None:
                    channels.setdefault(target, deque()).append(micro)
                progressed = True
        assert progressed, f"deadlock at pp={num_ranks}, {num_microbatches} microbatches"
    assert not any(channels.values()), "messages nobody received"
    return trace


@pytest.mark.parametrize("num_ranks", range(2, 9))
def test_plan_runs_every_microbatch_without_deadlock(num_ranks: int) -> None:
    for micro in range(2 * num_ranks, 2 * num_ranks + 6):
        trace = simulate(num_ranks, micro)
        for rank, ops in enumerate(trace):
            for kind in ("F", "B"):
                for chunk in (0, 1):
                    got = [m for k, c, m in ops if (k, c) == (kind, chunk)]
                    assert got == list(range(micro)), (num_ranks, micro, rank, kind, chunk)


def test_plan_shape_at_pp2() -> None:
    # Rank 0 warms up with F0, F0 (the V's depth), rank 1 turns at once; both end with backwards.
    assert dualpipev_plan(0, 2, 4)[:4] == [("F", 0), ("F", 0), ("F", 0), ("F", 1)]
    assert dualpipev_plan(1, 2, 4)[:4] == [("F", 0), ("F", 1), ("F", 0), ("F", 1)]
    assert ("FB", 0, 1) in dualpipev_plan(0, 2, 4) and dualpipev_plan(0, 2, 4)[-1] == ("B", 0)
    assert dualpipev_plan(1, 2, 4, forward_only=True) == [("F", 0)] * 4 + [("F", 1)] * 4


def test_plan_and_chunks_refuse_bad_sizes() -> None:
    with pytest.raises(ValueError, match=r"num_microbatches >= 2 x pp = 8, got 7; raise train.global_batch_size"):
        dualpipev_plan(0, 4, 7)
    with pytest.raises(ValueError, match="pp >= 2"):
        dualpipev_plan(0, 1, 4)
    assert dualpipev_chunks(8, 2) == [[range(0, 2), range(6, 8)], [range(2, 4), range(4, 6)]]
    with pytest.raises(ValueError, match=r"num_layers=6 is not divisible by 2 x pp = 4"):
        dualpipev_chunks(6, 2)


FACTS = {"num_layers": 8, "num_microbatches": 8}
ON = FeaturesConfig(settings={"dualpipev": {"enabled": True}})


def _ctx(parallel: dict | None = None, moe: int = 0, accelerator: str = "cpu", **extra: object) -> BuildContext:
    sizes = ParallelSizes(**{"pp": 2, **(parallel or {})})
    model = ModelFacts(num_moe_experts=moe, extra={**FACTS, **extra})
    return BuildContext(accelerator=accelerator, parallel=sizes, model=model)


def test_feature_is_opt_in_and_sets_two_chunks() -> None:
    feature = FEATURES.get("dualpipev")
    assert feature.level == 2 and feature.flags == ("--schedules-method dualpipev",)
    assert "dualpipev" not in apply_features(FeaturesConfig(optimization_level=2), _ctx()).enabled
    ctx = _ctx()
    assert "dualpipev" in apply_features(ON, ctx).enabled
    assert ctx.config_overrides["virtual_pipeline_model_parallel_size"] == 2


@pytest.mark.parametrize(
    ("parallel", "extra", "message"),
    [
        ({"pp": 1}, {}, r"pp=1; set parallel.pp >= 2"),
        ({"vpp": 2}, {}, r"parallel.vpp=2 is set.*; unset parallel.vpp"),
        ({"cp": 2}, {}, r"context parallelism \(cp=2\).*; use parallel.cp=1"),
        ({}, {"num_layers": 6}, r"model.num_layers=6 does not split into 2 x pp = 4 chunks"),
        ({"pp": 4}, {"num_microbatches": 6}, r"6 microbatches per step, it needs >= 2 x pp = 8"),
        (
            {},
            {"num_microbatches": 3},
            r"3 microbatches per step, it needs >= 2 x pp = 4; raise train.global_batch_size",
        ),
        ({}, {"overlap_grad_reduce": True}, r"set parallel.overlap_grad_reduce=false"),
        ({}, {"variable_seq_lengths": True}, r"set data.variable_seq_lengths=false"),
        ({}, {"mtp_num_layers": 1}, r"multi-token prediction"),
        ({}, {"hf_weights": True}, r"Hugging Face exports.*; convert the megatron checkpoint afterwards"),
        ({}, {"lora": True}, r"LoRA adapters.*; set lora.enabled=false"),
    ],
)
def test_feature_refuses_what_does_not_compose(parallel: dict, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match="feature 'dualpipev': .*" + message) as error:
        apply_features(ON, _ctx(parallel, **extra))
    assert "\n" not in str(error.value)


def test_feature_accepts_accelerators() -> None:
    # Each kind of message has its own group and no tags (matched by order, as NCCL/HCCL match them);
    # the gloo runs of tests/llm/training/test_dualpipev.py exchange the same way.
    apply_features(ON, _ctx(accelerator="gpu"))


def test_feature_accepts_moe_and_refuses_noop_layers_and_swap_attention() -> None:
    # MoE / EP: proven against 1F1B and one rank in tests/llm/training/test_dualpipev.py.
    # And tied embeddings (rank 0 holds both copies), proven there too.
    assert "dualpipev" in apply_features(ON, _ctx({"ep": 2}, moe=4, tie_embeddings=True)).enabled
    both = FeaturesConfig(settings={"dualpipev": {"enabled": True}, "noop_layers": {"enabled": True}})
    with pytest.raises(ValueError, match="dualpipev.*noop_layers|noop_layers.*dualpipev"):
        apply_features(both, _ctx(noop_layers=[0]))
    for other in ("swap_attention", "recompute_in_bubble", "recompute_in_advance", "tp_2d"):
        both = FeaturesConfig(settings={"dualpipev": {"enabled": True}, other: {"enabled": True}})
        with pytest.raises(ValueError, match=f"dualpipev.*{other}|{other}.*dualpipev"):
            apply_features(both, _ctx())
