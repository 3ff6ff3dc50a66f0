"""MoE features beyond kernels: expert layout, shared experts, load balancing, expert-load metrics.

The kernel features ``moe_grouped_gemm`` and ``moe_permute_fusion`` live in
:mod:`mindspeed.features.kernels`. The features here write megatron-core ``TransformerConfig``
fields into ``ctx.config_overrides`` (the builder sets them on the config, and the expert
layout also on ``initialize_model_parallel``), or attach hooks for the trainer. None of them
changes the model's math unless enabled explicitly: each is opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import BuildContext
from mindspeed.metrics.moe import ExpertLoadTracker

#: megatron-core 0.16's load-balancing strategies.
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
#: The ones that add an auxiliary loss scaled by ``moe_aux_loss_coeff``.
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
#: The ``TransformerConfig`` fields that :class:`MoETpExtendEpFeature` sets; they also go to
#: megatron's ``initialize_model_parallel`` (same names there).
EXPERT_LAYOUT_FIELDS = ("expert_model_parallel_size", "expert_tensor_parallel_size")


class MoEModelFeature(Feature):
    """A feature that only makes sense for a model with routed experts."""

    def check_moe(self, ctx: BuildContext) -> None:
        """Raise unless the model may have routed experts (unknown facts pass)."""
        if ctx.model.is_moe is False:
            raise self.invalid("the model has no routed experts (num_moe_experts=0)", "use it with a MoE model")


class MoETpExtendEpFeature(MoEModelFeature):
    """``--moe-tp-extend-ep``: tensor-parallel ranks hold different experts instead of expert slices.

    megatron-core builds expert groups from its own sizes: expert-tensor-parallel (ETP) x
    expert-parallel (EP) x expert-data-parallel over the same ranks as TP x CP x DP. Setting
    ``expert_tensor_parallel_size=1`` and ``expert_model_parallel_size=tp * ep`` turns the TP
    ranks into more expert-parallel ranks: every expert is whole on one rank (no TP all-gather
    or reduce-scatter of expert activations, bigger GEMMs), and each rank holds
    ``num_experts / (tp * ep)`` experts. Attention stays tensor-parallel. megatron needs
    sequence parallelism when MoE is trained with TP > 1.
    """

    name = "moe_tp_extend_ep"
    level = 2
    flags = ("--moe-tp-extend-ep",)
    description = "TP ranks also split the experts (expert_tensor_parallel_size=1, EP x TP expert groups)"
    targets = tuple(f"config_overrides.{f}" for f in EXPERT_LAYOUT_FIELDS)

    def validate(self, cfg: FeatureConfig, ctx: BuildContext) -> None:
        """Needs TP > 1 and ``num_experts`` divisible by ``tp * ep``."""
        self.check_moe(ctx)
        tp, ep = ctx.parallel.tp, ctx.parallel.ep
        if tp == 1:
            raise self.invalid(
                "tensor-parallel size is 1, so there are no TP ranks to give experts to", "use it with tp > 1"
            )
        experts = ctx.model.num_moe_experts
        if experts and experts % (tp * ep):
            raise self.invalid(
                f"num_moe_experts={experts} is not divisible by the extended expert-parallel "
                f"size tp * ep = {tp} * {ep} = {tp * ep}",
                "choose a number of experts divisible by tp * ep",
            )

    def apply(self, cfg: FeatureConfig, ctx: BuildContext) -> list[Change]:
        """Set the expert layout fields."""
        size = ctx.parallel.tp * ctx.parallel.ep
        return [
            ctx.set_config("expert_model_parallel_size", size, f"tp * ep = {ctx.parallel.tp} * {ctx.parallel.ep}"),
            ctx.set_config("expert_tensor_parallel_size", 1, "experts are not tensor-parallel"),
        ]


@dataclass
class SharedExpertsConfig(FeatureConfig):
    """Settings of the shared experts.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        intermediate_size: FFN width of the shared expert(s) together
            (``--moe-shared-expert-intermediate-size``).
        n_shared_experts: MindSpeed's deprecated ``--n-shared-experts``: the width is this many
            routed experts' ``moe_ffn_hidden_size`` (needs ``ModelFacts.extra['moe_ffn_hidden_size']``).
        gate: a sigmoid gate on the shared output (``moe_shared_expert_gate``).
        overlap: compute the shared expert during the token all-to-all
            (``moe_shared_expert_overlap``, alltoall dispatcher only).
    """

    intermediate_size: int | None = None
    n_shared_experts: int | None = None
    gate: bool = False
    overlap: bool = False


class MoESharedExpertsFeature(MoEModelFeature):
    """``--moe-shared-expert-intermediate-size`` / ``--n-shared-experts``: experts every token goes through."""

    name = "moe_shared_experts"
    Config = SharedExpertsConfig
    level = 0
    flags = ("--moe-shared-expert-intermediate-size", "--n-shared-experts", "--moe-shared-expert-overlap")
    description = "shared experts beside the routed ones (a model property: opt-in)"
    targets = (
        "config_overrides.moe_shared_expert_intermediate_size",
        "config_overrides.moe_shared_expert_gate",
        "config_overrides.moe_shared_expert_overlap",
    )

    def validate(self, cfg: SharedExpertsConfig, ctx: BuildContext) -> None:
        """Exactly one positive size; overlap only with the alltoall dispatcher."""
        self.check_moe(ctx)
        self.intermediate_size(cfg, ctx)
        dispatcher = ctx.model.moe_token_dispatcher_type
        if cfg.overlap and dispatcher not in (None, "alltoall"):
            raise self.invalid(
                f"overlap needs the alltoall dispatcher, the model uses {dispatcher!r}",
                f"set settings.{self.name}.overlap=false",
            )

    def intermediate_size(self, cfg: SharedExpertsConfig, ctx: BuildContext) -> int:
        """The shared experts' FFN width from either setting.

        Raises:
            ValueError: when neither or both are given, a value is not positive, or the routed
                experts' width needed by ``n_shared_experts`` is unknown.
        """
        if (cfg.intermediate_size is None) == (cfg.n_shared_experts is None):
            raise self.invalid(
                "give exactly one of intermediate_size and n_shared_experts",
                f"set settings.{self.name}.intermediate_size (preferred)",
            )
        if cfg.intermediate_size is not None:
            if cfg.intermediate_size <= 0:
                raise self.invalid(f"intermediate_size={cfg.intermediate_size} is not positive", "use a width > 0")
            return cfg.intermediate_size
        width = ctx.model.extra.get("moe_ffn_hidden_size")
        if cfg.n_shared_experts <= 0:
            raise self.invalid(f"n_shared_experts={cfg.n_shared_experts} is not positive", "use a count > 0")
        if not width:
            raise self.invalid(
                "n_shared_experts needs the routed experts' moe_ffn_hidden_size, which the model facts do not give",
                "set intermediate_size, or pass ModelFacts(extra={'moe_ffn_hidden_size': ...})",
            )
        return cfg.n_shared_experts * int(width)

    def apply(self, cfg: SharedExpertsConfig, ctx: BuildContext) -> list[Change]:
        """Set the shared experts' width, gate and overlap."""
        size = self.intermediate_size(cfg, ctx)
        why = "" if cfg.intermediate_size else f"n_shared_experts={cfg.n_shared_experts} x moe_ffn_hidden_size"
        changes = [ctx.set_config("moe_shared_expert_intermediate_size", size, why)]
        if cfg.gate:
            changes.append(ctx.set_config("moe_shared_expert_gate", True))
        if cfg.overlap:
            changes.append(ctx.set_config("moe_shared_expert_overlap", True, "overlap with the token all-to-all"))
        return changes


@dataclass
class LoadBalancingConfig(FeatureConfig):
    """Settings of the router's load balancing.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        type: one of :data:`LOAD_BALANCING_TYPES` (``--moe-router-load-balancing-type``).
        aux_loss_coeff: the auxiliary loss' weight (``--moe-aux-loss-coeff``); must be
            positive for the aux-loss types and 0 for ``sinkhorn`` / ``none``.
        z_loss_coeff: router z-loss weight (``--moe-z-loss-coeff``), ``None`` for none.
    """

    type: str = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float | None = None


class MoELoadBalancingFeature(MoEModelFeature):
    """``--moe-router-load-balancing-type``: an auxiliary loss (or Sinkhorn) that evens out expert load."""

    name = "moe_load_balancing"
    Config = LoadBalancingConfig
    level = 2
    flags = ("--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-z-loss-coeff")
    description = "load-balancing auxiliary loss (aux_loss, seq_aux_loss, global_aux_loss) or sinkhorn routing"
    targets = (
        "config_overrides.moe_router_load_balancing_type",
        "config_overrides.moe_aux_loss_coeff",
        "config_overrides.moe_z_loss_coeff",
    )

    def validate(self, cfg: LoadBalancingConfig, ctx: BuildContext) -> None:
        """A known type with a coefficient that fits it."""
        self.check_moe(ctx)
        if cfg.type not in LOAD_BALANCING_TYPES:
            raise self.invalid(
                f"type={cfg.type!r} is not one of {', '.join(LOAD_BALANCING_TYPES)}",
                f"set settings.{self.name}.type to one of them",
            )
        if cfg.type in AUX_LOSS_TYPES and cfg.aux_loss_coeff <= 0:
            raise self.invalid(
                f"type {cfg.type!r} with aux_loss_coeff={cfg.aux_loss_coeff} adds no loss",
                "use a positive coefficient (1e-3 to 1e-2 is usual)",
            )
        if cfg.type not in AUX_LOSS_TYPES and cfg.aux_loss_coeff != 0:
            raise self.invalid(
                f"type {cfg.type!r} has no auxiliary loss but aux_loss_coeff={cfg.aux_loss_coeff}",
                f"set settings.{self.name}.aux_loss_coeff=0",
            )
        if cfg.z_loss_coeff is not None and cfg.z_loss_coeff < 0:
            raise self.invalid(f"z_loss_coeff={cfg.z_loss_coeff} is negative", "use a coefficient >= 0 or null")

    def apply(self, cfg: LoadBalancingConfig, ctx: BuildContext) -> list[Change]:
        """Set the strategy and its coefficients."""
        changes = [
            ctx.set_config("moe_router_load_balancing_type", cfg.type),
            ctx.set_config("moe_aux_loss_coeff", cfg.aux_loss_coeff),
        ]
        if cfg.z_loss_coeff is not None:
            changes.append(ctx.set_config("moe_z_loss_coeff", cfg.z_loss_coeff))
        return changes


@dataclass
class ExpertBiasConfig(FeatureConfig):
    """Settings of aux-loss-free balancing.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        update_rate: the bias step per optimizer step (``--moe-router-bias-update-rate``).
    """

    update_rate: float = 1e-3


class MoEExpertBiasFeature(MoEModelFeature):
    """``--moe-router-enable-expert-bias``: aux-loss-free balancing with a per-expert routing bias.

    After each step megatron's ``finalize_model_grads`` counts the tokens each expert got
    (summed over TP x DP x CP) and moves every expert's bias by ``update_rate`` towards the
    mean load (DeepSeek-V3). The bias only shifts which experts are chosen, not their weights;
    megatron requires the sigmoid score function for it.
    """

    name = "moe_router_expert_bias"
    Config = ExpertBiasConfig
    level = 2
    flags = ("--moe-router-enable-expert-bias", "--moe-router-bias-update-rate")
    description = "aux-loss-free load balancing: per-expert routing bias updated towards even load"
    targets = (
        "config_overrides.moe_router_enable_expert_bias",
        "config_overrides.moe_router_bias_update_rate",
        "config_overrides.moe_router_score_function",
    )

    def validate(self, cfg: ExpertBiasConfig, ctx: BuildContext) -> None:
        """A positive update rate."""
        self.check_moe(ctx)
        if cfg.update_rate <= 0:
            raise self.invalid(f"update_rate={cfg.update_rate} does not move the bias", "use a rate > 0 (1e-3)")

    def apply(self, cfg: ExpertBiasConfig, ctx: BuildContext) -> list[Change]:
        """Turn the bias on, set its rate and the sigmoid score function it needs."""
        return [
            ctx.set_config("moe_router_enable_expert_bias", True),
            ctx.set_config("moe_router_bias_update_rate", cfg.update_rate),
            ctx.set_config("moe_router_score_function", "sigmoid", "megatron's expert bias needs sigmoid scores"),
        ]


@dataclass
class ExpertLoadMetricsConfig(FeatureConfig):
    """Settings of the per-expert token counts in the logs.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        interval: log every this many steps (the counts cover all steps since the last log).
        per_layer: log every layer's counts, not only the summary.
    """

    interval: int = 1
    per_layer: bool = True


class MoEExpertLoadMetricsFeature(MoEModelFeature):
    """``--print-expert-load``: tokens per expert per layer in the logs, with max/mean imbalance.

    Adds two hooks: ``post_model_build`` attaches an
    :class:`~mindspeed.metrics.moe.ExpertLoadTracker` to the routers (forward hooks,
    nothing patched) and ``post_step`` logs on rank 0 (a collective: every rank must call it).
    """

    name = "moe_expert_load_metrics"
    Config = ExpertLoadMetricsConfig
    level = 0
    flags = ("--print-expert-load", "--moe-per-layer-logging")
    description = "tokens per expert per layer in the logs, with a max/mean load-imbalance summary"
    targets = ("hooks.post_model_build", "hooks.post_step")

    def validate(self, cfg: ExpertLoadMetricsConfig, ctx: BuildContext) -> None:
        """A positive interval."""
        self.check_moe(ctx)
        if cfg.interval < 1:
            raise self.invalid(f"interval={cfg.interval} is not positive", "log every >= 1 steps")

    def apply(self, cfg: ExpertLoadMetricsConfig, ctx: BuildContext) -> list[Change]:
        """Attach the tracker after the model is built and log after steps."""
        tracker = ExpertLoadTracker(interval=cfg.interval, per_layer=cfg.per_layer)
        return [
            ctx.add_hook("post_model_build", tracker.attach, "forward hooks on the MoE routers"),
            ctx.add_hook("post_step", tracker.log_step, f"every {cfg.interval} step(s), rank 0"),
        ]


def expert_layout(overrides: Any, ep: int, etp: int | None = None) -> tuple[int, int | None]:
    """The expert-parallel and expert-tensor-parallel sizes after ``ctx.config_overrides``.

    Args:
        overrides: the context's ``config_overrides`` (or any mapping).
        ep: the expert-parallel size without features.
        etp: the expert-tensor-parallel size without features (``None``: megatron's default, tp).

    Returns:
        ``(expert_model_parallel_size, expert_tensor_parallel_size)`` for
        ``initialize_model_parallel`` and the ``TransformerConfig``.
    """
    return (overrides.get("expert_model_parallel_size", ep), overrides.get("expert_tensor_parallel_size", etp))


#: The features of this module, in the order the manifest registers them.
MOE_FEATURES: tuple[type[Feature], ...] = (
    MoETpExtendEpFeature,
    MoESharedExpertsFeature,
    MoELoadBalancingFeature,
    MoEExpertBiasFeature,
    MoEExpertLoadMetricsFeature,
)
