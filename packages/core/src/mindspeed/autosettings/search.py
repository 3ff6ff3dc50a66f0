"""The search: every layout the job allows on the cluster, kept if it fits, ranked by step time."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from mindspeed.autosettings.layout import Layout
from mindspeed.autosettings.memory import MemoryEstimate, estimate_memory, stage_params
from mindspeed.autosettings.spec import ClusterSpec, JobSpec
from mindspeed.autosettings.steptime import TimeEstimate, estimate_step_time

#: Micro batch sizes tried (those dividing a data-parallel rank's share of the batch).
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Candidate:
    """A layout with its predictions."""

    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def features(self) -> int:
        """How many memory settings it turns on (fewer wins a tie)."""
        lay = self.layout
        return sum(
            (
                lay.recompute != "none",
                lay.recompute_activation,
                lay.recompute_norm,
                lay.swap_attention,
                lay.swap_optimizer,
                lay.reuse_fp32_param,
            )
        )

    @property
    def score(self) -> float:
        """What the search ranks by: the step time, 0.1 % longer per memory setting turned on (a
        setting whose cost the model sees as hidden must buy something to be chosen)."""
        return self.time.total * (1 + 1e-3 * self.features)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _parallel_sizes(job: JobSpec, cluster: ClusterSpec) -> Iterator[tuple[int, int, int, int, int | None, int]]:
    """``(tp, pp, cp, dp, vpp, ep)`` the model and the cluster allow."""
    s, world = job.shape, cluster.world_size
    for tp in _divisors(cluster.nproc_per_node):
        if s.num_attention_heads % tp or s.num_query_groups % tp:
            continue
        for pp in _divisors(world // tp):
            if s.num_layers % pp:
                continue
            for cp in _divisors(world // (tp * pp)):
                if cp > 1 and job.seq_length % (2 * cp):
                    continue
                if (job.seq_length // cp) % tp:  # sequence parallelism splits every sequence over tp
                    continue
                dp = world // (tp * pp * cp)
                if job.global_batch_size % dp:
                    continue
                vpps: list[int | None] = [None]
                if pp > 1:
                    vpps += [v for v in range(2, s.num_layers // pp + 1) if s.num_layers % (pp * v) == 0][:3]
                experts = [e for e in _divisors(dp) if s.num_experts and s.num_experts % e == 0] or [1]
                for vpp, ep in itertools.product(vpps, experts):
                    yield tp, pp, cp, dp, vpp, ep


def _memory_settings(job: JobSpec, layers_per_chunk: int) -> Iterator[dict]:
    """The recompute, swap and fp32-reuse combinations tried on every layout."""
    fulls = sorted({max(1, layers_per_chunk * k // 4) for k in (1, 2, 3, 4)})
    recomputes = [("none", 0), ("selective", 0)] + [("full", k) for k in fulls]
    optimizers = [{}, {"swap_optimizer": True}]
    if job.precision == "bf16":
        optimizers.append({"reuse_fp32_param": True})
    for (recompute, k), act, norm, swap, opt in itertools.product(
        recomputes, (False, True), (False, True), (False, True), optimizers
    ):
        if recompute == "full" and k >= layers_per_chunk and (act or norm or swap):
            continue  # every layer is recomputed whole: nothing left to discard or swap
        yield dict(
            recompute=recompute,
            recompute_layers=k,
            recompute_activation=act,
            recompute_norm=norm,
            swap_attention=swap,
            **opt,
        )


def enumerate_layouts(job: JobSpec, cluster: ClusterSpec) -> Iterator[list[Layout]]:
    """Every candidate, grouped by parallel layout and micro batch: the plain one (no memory
    setting) first, then its recompute / swap / fp32-reuse variants (the recipe's checks hold for each)."""
    for tp, pp, cp, dp, vpp, ep in _parallel_sizes(job, cluster):
        share = job.global_batch_size // dp
        layers_per_chunk = job.shape.num_layers // (pp * (vpp or 1))
        for micro in MICRO_BATCH_SIZES:
            if share % micro:
                continue
            if vpp and (share // micro) % pp:
                continue  # the interleaved schedule needs a multiple of pp microbatches
            group = []
            for settings in _memory_settings(job, layers_per_chunk):
                distributed = dp > 1 or bool(settings.get("swap_optimizer"))
                group.append(
                    Layout(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        cp=cp,
                        ep=ep,
                        vpp=vpp,
                        micro_batch_size=micro,
                        sequence_parallel=tp > 1,
                        distributed_optimizer=distributed,
                        **settings,
                    )
                )
            yield group


def evaluate(job: JobSpec, layout: Layout, cluster: ClusterSpec, memory: MemoryEstimate | None = None) -> Candidate:
    """Predict one layout's peak memory (unless given) and step time."""
    memory = memory or estimate_memory(job, layout)
    params = max(stage_params(job, layout, stage)[0] for stage in {0, layout.pp - 1})
    return Candidate(layout, memory, estimate_step_time(job, layout, cluster, params))


def search(job: JobSpec, cluster: ClusterSpec, top: int = 5, margin: float = 0.1) -> tuple[list[Candidate], int]:
    """The fastest layouts whose predicted peak fits in the device memory with ``margin`` to spare.

    Args:
        job: the model and batch.
        cluster: the devices.
        top: how many to return.
        margin: fraction of the device memory kept free (allocator fragmentation, the model's error).

    Returns:
        The best ``top`` candidates (by :attr:`Candidate.score`, then memory) and how many
        layouts were evaluated.

    Raises:
        ValueError: nothing fits (naming the layout that needs the least memory), or the
            cluster allows no layout of this model at all.
    """
    budget = cluster.device_memory_bytes * (1 - margin)
    fitting: list[Candidate] = []
    smallest: tuple[Layout, MemoryEstimate] | None = None
    count = 0
    for group in enumerate_layouts(job, cluster):
        for layout in group:
            count += 1
            memory = estimate_memory(job, layout)
            if memory.peak <= budget:
                fitting.append(evaluate(job, layout, cluster, memory))
                if layout is group[0]:
                    break  # every memory setting only adds time: the plain layout beats its variants
            elif smallest is None or memory.peak < smallest[1].peak:
                smallest = (layout, memory)
    if not count:
        raise ValueError(
            f"no layout of this model fits {cluster.world_size} devices and global batch "
            f"{job.global_batch_size}: the batch must divide over data-parallel ranks and the heads and "
            "layers over tensor and pipeline ranks; change --nnodes/--nproc-per-node or train.global_batch_size"
        )
    if not fitting:
        assert smallest is not None
        raise ValueError(
            f"no layout fits in {cluster.device_memory_bytes / 2**30:.3g} GiB per device "
            f"(less {margin:.0%} margin); the smallest needs {smallest[1].peak / 2**30:.3g} GiB "
            f"({smallest[0].label()}): add devices or memory, or shorten data.seq_length"
        )
    fitting.sort(key=lambda c: (c.score, c.memory.peak))
    return fitting[:top], count
