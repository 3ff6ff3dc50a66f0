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
from mindspeed.memory.recompute import ACTIVATION, NORM, LayerRecompute


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
        """``num_layers`` is positive and at most the model's layers (when the facts give them)."""
        if cfg.num_layers is None:
            return
        if cfg.num_layers < 1:
            raise self.invalid(f"num_layers={cfg.num_layers} recomputes nothing", "use num_layers >= 1 or null (all)")
        total = ctx.model.extra.get("num_layers")
        if total is not None and cfg.num_layers > int(total):
            raise self.invalid(f"num_layers={cfg.num_layers} is more than the model's {total} layers",
                               "use at most the model's layers, or null for all")

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


#: The features of this module, in the order the manifest registers them.
MEMORY_FEATURES: tuple[type[Feature], ...] = (
    RecomputeActivationFunctionFeature,
    RecomputeNormFeature,
)
