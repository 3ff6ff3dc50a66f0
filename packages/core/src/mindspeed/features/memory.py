"""Memory features: MindSpeed's recompute, swap and fp32-reuse flags over :mod:`mindspeed.memory`.

Each feature attaches a hook the trainers already call (``post_model_build`` with the model
chunks, ``post_optimizer_build`` with megatron's optimizer); the hook does the work on the
built objects, so no builder needs to know the feature. All are level 2 and opt-in: they trade
compute or host bandwidth for device memory, which only the user can weigh.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import BuildContext
from mindspeed.memory.fp32_reuse import ReuseFp32Param
from mindspeed.memory.recompute import ACTIVATION, NORM, LayerRecompute
from mindspeed.memory.swap_attention import DEFAULT_MODULES, MODULE_NAMES, SwapAttention
from mindspeed.memory.swap_optimizer import DEFAULT_TIMES, SwapOptimizer


@dataclass
class LayerRecomputeConfig(FeatureConfig):
    """Settings of an output-discarding recompute.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        num_layers: recompute in the first ``num_layers`` layers of each pipeline stage
            (``--recompute-*-num-layers``); ``None``: every layer.
    """

    num_layers: int | None = None


class _LayerRecomputeFeature(Feature):
    """Shared part of the two recompute features (the kind is the subclass')."""

    kind = ""
    Config = LayerRecomputeConfig
    level = 2
    targets = ("hooks.post_model_build",)

    def validate(self, cfg: LayerRecomputeConfig, ctx: BuildContext) -> None:
        """``num_layers`` is positive and at most the model's layers (when the facts give them); with
        megatron's full recompute only ``recompute_method: block`` leaves layers for this feature (as
        in MindSpeed)."""
        facts = ctx.model.extra
        if facts.get("recompute_granularity") == "full" and facts.get("recompute_method") != "block":
            raise self.invalid(
                f"megatron's full recompute with recompute_method={facts.get('recompute_method')} already "
                "recomputes every layer",
                "use model.recompute_method: block (the first recompute_num_layers layers fully recomputed, "
                "this feature on the rest) or turn one of them off",
            )
        if cfg.num_layers is None:
            return
        if cfg.num_layers < 1:
            raise self.invalid(f"num_layers={cfg.num_layers} recomputes nothing", "use num_layers >= 1 or null (all)")
        total = ctx.model.extra.get("num_layers")
        if total is not None and cfg.num_layers > int(total):
            raise self.invalid(
                f"num_layers={cfg.num_layers} is more than the model's {total} layers",
                "use at most the model's layers, or null for all",
            )

    def apply(self, cfg: LayerRecomputeConfig, ctx: BuildContext) -> list[Change]:
        """Install the recompute on the built chunks."""
        hook = LayerRecompute(self.kind, cfg.num_layers)
        layers = "every layer" if cfg.num_layers is None else f"first {cfg.num_layers} layers of each stage"
        return [ctx.add_hook("post_model_build", hook.install, f"output-discarding checkpoint, {layers}")]


class RecomputeActivationFunctionFeature(_LayerRecomputeFeature):
    """``--recompute-activation-function``: drop the MLP activation's output, recompute it in the backward.

    Saves the activation output per layer (``tokens x ffn / tp x dtype`` bytes for SwiGLU) for
    one extra activation per layer in the backward. Needs the activation as a module (the
    registry spec's SwiGLU, ``use_te_activation_func=True``); grouped experts use their own.
    """

    name = "recompute_activation_function"
    kind = ACTIVATION
    flags = ("--recompute-activation-function", "--recompute-activation-function-num-layers")
    description = "output-discarding recompute of the MLP activation (saves tokens x ffn/tp per layer)"


class RecomputeNormFeature(_LayerRecomputeFeature):
    """``--recompute-norm``: drop the outputs of both norms of a layer, recompute them in the backward.

    Saves ``2 x tokens x hidden x dtype`` bytes per layer plus the norms' statistics; little
    under sequence parallelism, where the norm outputs are already sharded.
    """

    name = "recompute_norm"
    kind = NORM
    flags = ("--recompute-norm", "--recompute-norm-num-layers")
    description = "output-discarding recompute of input_layernorm and pre_mlp_layernorm"


@dataclass
class SwapAttentionConfig(FeatureConfig):
    """Settings of the activation swap.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        swap_modules: MindSpeed's ``--swap-modules`` names whose saved activations go to the
            host: ``input_norm``, ``self_attention``, ``post_attention_norm``.
        min_bytes: saved tensors smaller than this stay on the device.
    """

    swap_modules: tuple[str, ...] = DEFAULT_MODULES
    min_bytes: int = 1 << 14


class SwapAttentionFeature(Feature):
    """``--swap-attention``: the chosen modules' saved activations go to the host in the forward.

    Device -> host on the accelerator's side stream in the forward, host -> device one layer
    ahead in the backward; the values are copied, not recomputed, so training is unchanged.
    """

    name = "swap_attention"
    Config = SwapAttentionConfig
    level = 2
    flags = ("--swap-attention", "--swap-modules")
    description = "saved activations of attention (and its norms) swapped to host memory, prefetched a layer ahead"
    targets = ("hooks.post_model_build",)

    def validate(self, cfg: SwapAttentionConfig, ctx: BuildContext) -> None:
        """Known module names, at least one."""
        unknown = [m for m in cfg.swap_modules if m not in MODULE_NAMES]
        if unknown or not cfg.swap_modules:
            raise self.invalid(
                f"swap_modules={list(cfg.swap_modules)} names no or unknown modules {unknown}",
                f"use some of {sorted(MODULE_NAMES)}",
            )

    def apply(self, cfg: SwapAttentionConfig, ctx: BuildContext) -> list[Change]:
        """Install the swap on the built chunks."""
        hook = SwapAttention(modules=tuple(cfg.swap_modules), min_bytes=cfg.min_bytes)
        return [ctx.add_hook("post_model_build", hook.install, f"swap {', '.join(cfg.swap_modules)} to the host")]


class ReuseFp32ParamFeature(Feature):
    """``--reuse-fp32-param``: bf16 weights + 16-bit remainders instead of a resident fp32 master.

    Saves 2 bytes per parameter (per data-parallel shard with the distributed optimizer); the
    masters are rebuilt bit for bit at the step, so training equals megatron's bf16 optimizer.
    The model facts may say ``extra["precision"]``; anything but ``bf16`` is refused.
    """

    name = "reuse_fp32_param"
    level = 2
    flags = ("--reuse-fp32-param",)
    conflicts = ("swap_optimizer",)
    description = "fp32 masters kept as bf16 weight + int16 remainder between steps (saves 2 bytes/param)"
    targets = ("hooks.post_optimizer_build",)

    def validate(self, cfg: FeatureConfig, ctx: BuildContext) -> None:
        """bf16 training (when the facts say the precision)."""
        precision = ctx.model.extra.get("precision")
        if precision is not None and precision != "bf16":
            raise self.invalid(
                f"the run trains in {precision}, which has no fp32 master copy to save",
                "train in bf16 (train.precision=bf16)",
            )

    def apply(self, cfg: FeatureConfig, ctx: BuildContext) -> list[Change]:
        """Wrap megatron's optimizer once it is built."""
        return [
            ctx.add_hook(
                "post_optimizer_build",
                ReuseFp32Param().install,
                "masters as int16 remainders, rebuilt one parameter at a time at the step",
            )
        ]


@dataclass
class SwapOptimizerConfig(FeatureConfig):
    """Settings of the optimizer swap.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        swap_optimizer_times: chunks the state goes through the device in at each step
            (``--swap-optimizer-times``); the step holds about ``1 / times`` of the state.
    """

    swap_optimizer_times: int = DEFAULT_TIMES


class SwapOptimizerFeature(Feature):
    """``--swap-optimizer``: the distributed optimizer's fp32 master and Adam moments live on the host.

    Frees 12 bytes per parameter of the rank's shard (8 in fp32 training) from the device
    between steps; the step streams them through the device in ``swap_optimizer_times``
    chunks. Needs the distributed optimizer (the model facts may say
    ``extra["distributed_optimizer"]``; the hook checks the optimizer itself too).
    """

    name = "swap_optimizer"
    Config = SwapOptimizerConfig
    level = 2
    flags = ("--swap-optimizer", "--swap-optimizer-times")
    conflicts = ("reuse_fp32_param",)
    description = "distributed optimizer's fp32 state in host memory, streamed through the device in chunks"
    targets = ("hooks.post_optimizer_build",)

    def validate(self, cfg: SwapOptimizerConfig, ctx: BuildContext) -> None:
        """At least one chunk, and the distributed optimizer (when the facts say)."""
        if cfg.swap_optimizer_times < 1:
            raise self.invalid(
                f"swap_optimizer_times={cfg.swap_optimizer_times} is not positive",
                "use 1 or more chunks (16 is MindSpeed's default)",
            )
        if ctx.model.extra.get("distributed_optimizer") is False:
            raise self.invalid(
                "the run does not use the distributed optimizer, whose state shard it swaps",
                "set parallel.distributed_optimizer=true",
            )

    def apply(self, cfg: SwapOptimizerConfig, ctx: BuildContext) -> list[Change]:
        """Move the optimizer's state to the host once it is built."""
        hook = SwapOptimizer(times=cfg.swap_optimizer_times)
        return [
            ctx.add_hook(
                "post_optimizer_build", hook.install, f"{cfg.swap_optimizer_times} chunks per step through the device"
            )
        ]


#: The features of this module, in the order the manifest registers them.
MEMORY_FEATURES: tuple[type[Feature], ...] = (
    RecomputeActivationFunctionFeature,
    RecomputeNormFeature,
    SwapAttentionFeature,
    ReuseFp32ParamFeature,
    SwapOptimizerFeature,
)
