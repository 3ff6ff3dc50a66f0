"""Context parallelism as a feature: MindSpeed's ``--context-parallel-*`` flags for megatron-core.

The algorithms live in :mod:`mindspeed.parallel.context_parallel`; inside megatron-core they
run in :class:`~mindspeed.megatron.modules.RegistryAttention`, which picks the algorithm from
megatron's own per-layer setting ``cp_comm_type`` ("p2p": ring, "a2a": Ulysses, "a2a+p2p":
hybrid with ``hierarchical_context_parallel_sizes = [U, R]``, "all_gather": KV all-gather). This feature translates
MindSpeed's names into those ``TransformerConfig`` fields, so nothing else needs to know them. The
double ring (``--cp-window-size``) and ``adaptive_cp_algo`` run on the ring's layout ("p2p") and
reach the layers as the attributes ``cp_window_size`` and ``cp_adaptive``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import BuildContext
from mindspeed.parallel.context_parallel import ADAPTIVE, HYBRID, KVALLGATHER, RING, ULYSSES, ContextParallelConfig

#: MindSpeed's ``context_parallel_algo`` -> megatron-core's ``cp_comm_type`` (the same map as
#: ``mindspeed.megatron.modules.CP_ALGO_COMM_TYPES``, kept here so that listing features does
#: not import megatron-core).
COMM_TYPES = {RING: "p2p", ULYSSES: "a2a", HYBRID: "a2a+p2p", KVALLGATHER: "all_gather", ADAPTIVE: "p2p"}


@dataclass
class ContextParallelFeatureConfig(FeatureConfig):
    """Settings of context parallelism.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        context_parallel_size: CP degree ``C``; ``None`` takes ``parallel.cp`` of the build.
        context_parallel_algo: ``megatron_cp_algo`` (ring, default), ``ulysses_cp_algo``,
            ``hybrid_cp_algo``, ``kvallgather_cp_algo`` (KV all-gather: megatron's ``all_gather``)
            or ``adaptive_cp_algo`` (ring, KV all-gather or no communication, chosen per call
            from the mask's non-empty blocks).
        ulysses_degree_in_cp: Ulysses degree ``U`` of ``hybrid_cp_algo`` (ring degree ``C / U``).
        cp_window_size: ``w > 1``: the ring as a double ring, an inner ring in each window of
            ``w`` consecutive CP ranks and an outer ring over the ``C / w`` windows
            (``--cp-window-size``; ``megatron_cp_algo`` or ``adaptive_cp_algo``).
    """

    context_parallel_size: int | None = None
    context_parallel_algo: str = RING
    ulysses_degree_in_cp: int | None = None
    cp_window_size: int = 1


class ContextParallelFeature(Feature):
    """Shard the sequence over ``C`` ranks; attention by Ulysses, ring, both, or KV all-gather.

    The model facts may carry ``extra["num_attention_heads"]`` and ``extra["num_query_groups"]``
    (per model, before TP); then the heads are checked against the Ulysses degree.
    """

    name = "context_parallel"
    Config = ContextParallelFeatureConfig
    level = 2
    flags = ("--context-parallel-size", "--context-parallel-algo", "--ulysses-degree-in-cp", "--cp-window-size")
    description = (
        "long sequences: Ulysses, ring (zig-zag; double ring with a window), hybrid, KV all-gather "
        "or adaptive attention over the CP group"
    )
    targets = (
        "config_overrides.context_parallel_size",
        "config_overrides.cp_comm_type",
        "config_overrides.hierarchical_context_parallel_sizes",
        "config_overrides.cp_window_size",
        "config_overrides.cp_adaptive",
    )

    def default_enabled(self, ctx: BuildContext) -> bool:
        """On whenever the build shards sequences (``parallel.cp > 1``): its settings pick the algorithm."""
        return ctx.parallel.cp > 1

    def why_off_by_default(self, ctx: BuildContext) -> str:
        """The build has no context parallelism."""
        return "parallel cp is 1: no sequence to shard"

    def _size(self, cfg: ContextParallelFeatureConfig, ctx: BuildContext) -> int:
        return ctx.parallel.cp if cfg.context_parallel_size is None else cfg.context_parallel_size

    def validate(self, cfg: FeatureConfig, ctx: BuildContext) -> None:
        """CP size > 1 and equal to the build's ``parallel.cp``; degrees and heads that divide."""
        assert isinstance(cfg, ContextParallelFeatureConfig)
        size = self._size(cfg, ctx)
        if size != ctx.parallel.cp:
            raise self.invalid(
                f"settings.{self.name}.context_parallel_size={size} but the parallel sizes of the "
                f"build have cp={ctx.parallel.cp}",
                "make the two agree (or leave the setting unset)",
            )
        if size < 2:
            raise self.invalid("context-parallel size is 1, so there is no sequence to shard", "use it with cp > 1")
        if cfg.context_parallel_algo not in COMM_TYPES:
            raise self.invalid(
                f"context_parallel_algo={cfg.context_parallel_algo!r} is unknown", f"use one of {sorted(COMM_TYPES)}"
            )
        try:
            config = ContextParallelConfig(
                context_parallel_size=size,
                context_parallel_algo=cfg.context_parallel_algo,
                ulysses_degree_in_cp=cfg.ulysses_degree_in_cp,
                cp_window_size=cfg.cp_window_size,
            )
            heads = ctx.model.extra.get("num_attention_heads")
            if heads is not None:
                config.check_heads(
                    int(heads),
                    int(ctx.model.extra.get("num_query_groups") or heads),
                    tensor_parallel_size=ctx.parallel.tp,
                )
        except ValueError as error:
            raise self.invalid(str(error), "change the CP settings or the parallel sizes") from error

    def apply(self, cfg: FeatureConfig, ctx: BuildContext) -> list[Change]:
        """Set ``context_parallel_size``, ``cp_comm_type``; for hybrid ``[U, R]``; the window; adaptive."""
        assert isinstance(cfg, ContextParallelFeatureConfig)
        size, algo = self._size(cfg, ctx), cfg.context_parallel_algo
        changes = [
            ctx.set_config("context_parallel_size", size, "--context-parallel-size"),
            ctx.set_config("cp_comm_type", COMM_TYPES[algo], f"--context-parallel-algo {algo}"),
        ]
        if algo == HYBRID:
            degree = int(cfg.ulysses_degree_in_cp or 1)
            changes.append(
                ctx.set_config(
                    "hierarchical_context_parallel_sizes",
                    [degree, size // degree],
                    f"--ulysses-degree-in-cp {degree}: Ulysses x ring",
                )
            )
        if cfg.cp_window_size > 1:
            changes.append(
                ctx.set_config(
                    "cp_window_size",
                    cfg.cp_window_size,
                    f"--cp-window-size {cfg.cp_window_size}: double ring, {size // cfg.cp_window_size} windows",
                )
            )
        if algo == ADAPTIVE:
            changes.append(ctx.set_config("cp_adaptive", True, "adaptive_cp_algo: algorithm chosen from the mask"))
        return changes
