"""``--noop-layers``: identity layers that balance pipeline stages, as megatron's own pipeline layout.

MindSpeed counts the noop layers among ``--num-layers`` and builds them as identities, so the
stages split ``num_layers`` evenly while the real layers are spread unevenly (a DeepSeek-V3 of
61 layers trains as 64 over 16 stages, say). megatron-core has the seam for exactly that:
``TransformerConfig.pipeline_model_parallel_layout`` places any number of decoder layers on
each (virtual) stage. This feature turns the noop indices into that layout, so no identity
module exists at all: a stage builds only its real layers, numbered globally, and checkpoints
(megatron's and the Hugging Face export) hold only the real layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import BuildContext


def parse_noop_layers(value: str | Sequence[int] | None) -> tuple[int, ...]:
    """The sorted, distinct layer indices of ``"0,5"``, ``[0, 5]`` or ``None`` (none).

    Raises:
        ValueError: an index that is not an integer.
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        return tuple(sorted({int(str(item).strip()) for item in items if str(item).strip()}))
    except ValueError as error:
        raise ValueError(f'noop_layers={value!r} is not a list of layer indices; write e.g. "0,5"') from error


def check_noop_layers(noop: Sequence[int], num_layers: int, stages: int) -> None:
    """``num_layers`` (noop layers included) splits into ``stages`` and keeps a real layer.

    Args:
        noop: the noop indices (:func:`parse_noop_layers`).
        num_layers: the layers with the noop ones (MindSpeed's ``--num-layers``).
        stages: pipeline stages times virtual stages.

    Raises:
        ValueError: naming the problem and the fix.
    """
    bad = [i for i in noop if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"noop_layers {bad} are not layers of num_layers={num_layers}; use indices 0..{num_layers - 1}"
        )
    if len(noop) >= num_layers:
        raise ValueError(f"noop_layers {list(noop)} leave no real layer of {num_layers}; drop some")
    if num_layers % stages:
        raise ValueError(
            f"num_layers={num_layers} (noop layers included) is not divisible by the {stages} pipeline stages; "
            "add noop layers or change the layout"
        )


def noop_layer_layout(noop: Sequence[int], num_layers: int, pp: int, vpp: int = 1) -> list[list[str]]:
    """megatron's ``pipeline_model_parallel_layout`` (list form) of ``num_layers`` with ``noop`` identities.

    The layers split evenly into ``pp x vpp`` consecutive chunks, in megatron's order (virtual
    stage 0 of every pipeline rank, then virtual stage 1, ...); each chunk keeps its real layers.

    Returns:
        One list per (virtual) stage: ``"embedding"`` first, ``"decoder"`` per real layer,
        ``"loss"`` last.
    """
    check_noop_layers(noop, num_layers, pp * vpp)
    per_stage, skip = num_layers // (pp * vpp), set(noop)
    layout = [
        ["decoder"] * sum(1 for i in range(s * per_stage, (s + 1) * per_stage) if i not in skip)
        for s in range(pp * vpp)
    ]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout


@dataclass
class NoopLayersConfig(FeatureConfig):
    """Settings of the noop layers.

    Attributes:
        enabled: see :class:`FeatureConfig` (default: on when ``noop_layers`` names a layer).
        noop_layers: the indices (``"0,5"``); ``None`` takes the model facts' ``extra["noop_layers"]``
            (an LLM recipe's ``model.noop_layers``).
    """

    noop_layers: str | list[int] | None = None


class NoopLayersFeature(Feature):
    """``--noop-layers``: layers among ``num_layers`` that are identities, to balance pipeline stages.

    Reads the model facts ``extra["num_layers"]`` (the real layers, which the model is built
    with) and ``extra["noop_layers"]``, and the parallel sizes' ``pp`` and ``vpp``; sets
    ``pipeline_model_parallel_layout``.
    """

    name = "noop_layers"
    Config = NoopLayersConfig
    level = 0
    flags = ("--noop-layers",)
    description = "identity layers that balance pipeline stages (megatron's pipeline_model_parallel_layout)"
    targets = ("config_overrides.pipeline_model_parallel_layout",)

    def _noop(self, cfg: NoopLayersConfig, ctx: BuildContext) -> tuple[int, ...]:
        return parse_noop_layers(cfg.noop_layers if cfg.noop_layers is not None else ctx.model.extra.get("noop_layers"))

    def default_enabled(self, ctx: BuildContext) -> bool:
        """On when the model facts name noop layers."""
        return bool(parse_noop_layers(ctx.model.extra.get("noop_layers")))

    def why_off_by_default(self, ctx: BuildContext) -> str:
        """The model names no noop layer."""
        return "the model has no noop layers"

    def validate(self, cfg: FeatureConfig, ctx: BuildContext) -> None:
        """Indices inside the layers, a real layer left, stages that divide the layers."""
        assert isinstance(cfg, NoopLayersConfig)
        try:
            noop = self._noop(cfg, ctx)
        except ValueError as error:
            raise self.invalid(str(error), "fix noop_layers") from error
        real = ctx.model.extra.get("num_layers")
        if not noop or real is None:
            raise self.invalid("no noop layer, or the model facts lack num_layers", 'set model.noop_layers, e.g. "0,5"')
        try:
            check_noop_layers(noop, int(real) + len(noop), ctx.parallel.pp * ctx.parallel.vpp)
        except ValueError as error:
            raise self.invalid(str(error), "change model.noop_layers or model.num_layers") from error

    def apply(self, cfg: FeatureConfig, ctx: BuildContext) -> list[Change]:
        """Set megatron's pipeline layout."""
        assert isinstance(cfg, NoopLayersConfig)
        noop = self._noop(cfg, ctx)
        total = int(ctx.model.extra["num_layers"]) + len(noop)
        layout = noop_layer_layout(noop, total, ctx.parallel.pp, ctx.parallel.vpp)
        flag = ",".join(map(str, noop))
        return [ctx.set_config("pipeline_model_parallel_layout", layout, f"--noop-layers {flag}: {total} layers")]


@dataclass
class DualPipeVConfig(FeatureConfig):
    """Settings of DualPipeV (none beyond ``enabled``: MindSpeed's ``--schedules-method dualpipev``)."""


class DualPipeVFeature(Feature):
    """``--schedules-method dualpipev``: DeepSeek's V-shaped schedule over two chunks per pipeline rank.

    Composes with MoE and expert parallelism (megatron keys its per-layer MoE bookkeeping by global
    layer number, which the V's chunks carry) and with tied embeddings (rank 0 holds both copies).
    Reads the parallel sizes and the model facts ``extra`` entries ``num_layers``,
    ``mtp_num_layers``, ``num_microbatches``, ``overlap_grad_reduce``,
    ``variable_seq_lengths``, ``hf_weights`` and ``lora`` (unknown ones are not checked); sets megatron's
    ``virtual_pipeline_model_parallel_size`` to 2, and the trainer builds the V's chunks and
    runs :func:`mindspeed.megatron.dualpipev.forward_backward_dualpipev`.
    """

    name = "dualpipev"
    Config = DualPipeVConfig
    level = 2
    flags = ("--schedules-method dualpipev",)
    # As MindSpeed's validation (swap_attention, tp_2d): swap_attention's prefetch follows one chunk's backward order;
    # the recompute-pipelining features wrap megatron's interleaved schedule, which the V does not run.
    conflicts = ("noop_layers", "swap_attention", "recompute_in_bubble", "recompute_in_advance", "tp_2d")
    description = "DualPipeV: V-shaped pipeline, two chunks per rank, forward/backward pairs of two microbatches"
    targets = ("config_overrides.virtual_pipeline_model_parallel_size", "schedule")

    def validate(self, cfg: FeatureConfig, ctx: BuildContext) -> None:
        """PP >= 2 without VPP or CP, layers in 2 x pp chunks, enough microbatches, what composes."""
        p, extra = ctx.parallel, ctx.model.extra
        if p.pp < 2:
            raise self.invalid(f"it is a pipeline schedule and the run has pp={p.pp}", "set parallel.pp >= 2")
        if p.vpp > 1:
            raise self.invalid(
                f"parallel.vpp={p.vpp} is set, and the V makes its own two chunks per rank", "unset parallel.vpp"
            )
        if p.cp > 1:
            raise self.invalid(f"context parallelism (cp={p.cp}) is not composed with it yet", "use parallel.cp=1")
        layers = extra.get("num_layers")
        if layers is not None and int(layers) % (2 * p.pp):
            raise self.invalid(
                f"model.num_layers={layers} does not split into 2 x pp = {2 * p.pp} chunks",
                "change model.num_layers or parallel.pp",
            )
        micro = extra.get("num_microbatches")
        if micro is not None and int(micro) < 2 * p.pp:
            raise self.invalid(
                f"{micro} microbatches per step, it needs >= 2 x pp = {2 * p.pp}",
                "raise train.global_batch_size or lower train.micro_batch_size",
            )
        refused = {
            "mtp_num_layers": ("multi-token prediction layers", "drop model.mtp_num_layers"),
            "overlap_grad_reduce": (
                "parallel.overlap_grad_reduce (it reduces gradients once, after the step)",
                "set parallel.overlap_grad_reduce=false",
            ),
            "variable_seq_lengths": (
                "variable sequence lengths through the pipeline",
                "set data.variable_seq_lengths=false",
            ),
            # The export's layer map reads megatron's interleaved order, not the V's (chunk 1 is stage 2P-1-r).
            "hf_weights": ("Hugging Face exports (checkpoint.save_hf)", "convert the megatron checkpoint afterwards"),
            "lora": ("LoRA adapters", "set lora.enabled=false"),
        }
        for key, (what, fix) in refused.items():
            if extra.get(key):
                raise self.invalid(f"{what} are not composed with it yet", fix)

    def apply(self, cfg: FeatureConfig, ctx: BuildContext) -> list[Change]:
        """Two chunks per rank (megatron's VPP=2 layer numbering); the trainer runs the V schedule."""
        pp = ctx.parallel.pp
        why = f"--schedules-method dualpipev: chunks r and {2 * pp - 1}-r on each of {pp} pipeline ranks"
        return [ctx.set_config("virtual_pipeline_model_parallel_size", 2, why)]
