"""2D tensor parallelism (MindSpeed's ``--tp-2d``, ``--tp-x``, ``--tp-y``).

The TP group of size ``tp = tp_x * tp_y`` works as a grid: the dense layers' weights are cut
along both axes and the hidden states between them are ``[s / tp_x, b, h / tp_y]``, so the
all-reduce of 1D TP becomes an all-gather and a reduce-scatter along each axis, and the norms
all-reduce their statistics along y (:mod:`mindspeed.megatron.tp2d`). The feature sets
``tp_x`` / ``tp_y`` on the model config; the LLM model builder then builds the layers with the
2D linears and norms. Checkpoints keep the 1D TP layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import BuildContext

#: Fields the feature sets on the model config; megatron's ``TransformerConfig`` has no such
#: fields, so :func:`mindspeed.megatron.config.transformer_config` sets them as attributes
#: (the same tuple there: the features do not import the megatron adaptor).
TP2D_FIELDS = ("tp_x", "tp_y")


@dataclass
class Tp2dConfig(FeatureConfig):
    """``tp_x`` / ``tp_y``: the grid (``tp_x * tp_y`` = the run's ``tp``, each > 1)."""

    tp_x: int = 1
    tp_y: int = 1


class Tp2dFeature(Feature):
    """The TP group as a ``tp_x x tp_y`` grid in the attention and MLP linears."""

    name = "tp_2d"
    Config = Tp2dConfig
    level = 2
    flags = ("--tp-2d", "--tp-x", "--tp-y")
    conflicts = ("coc",)
    description = "2D tensor parallelism: TP as a tp_x x tp_y grid, per-axis all-gather/reduce-scatter"
    targets = tuple(f"config_overrides.{name}" for name in TP2D_FIELDS)

    def validate(self, cfg: Tp2dConfig, ctx: BuildContext) -> None:
        """A grid of the run's TP, each axis > 1; dense models without CP (not covered).

        With megatron's sequence parallelism the chunks enter and leave the 2D layout from SP's
        ``[s / tp, b, h]`` (inside the layers the layout is the same), and PP composes (each
        stage's chunk enters and leaves it).
        """
        tp = ctx.parallel.tp
        if cfg.tp_x < 2 or cfg.tp_y < 2 or cfg.tp_x * cfg.tp_y != tp:
            raise self.invalid(
                f"tp_x={cfg.tp_x} * tp_y={cfg.tp_y} must equal parallel.tp={tp} with both > 1",
                "set settings.tp_2d.tp_x and tp_y (e.g. 2 and 2 for tp=4)",
            )
        if ctx.model.extra.get("compiled_layers"):
            # not traced yet: their collectives are async / chunked inside autograd.Functions (docs/llm/pretrain.md)
            raise self.invalid("train.compile does not trace 2D TP's linears yet", "set train.compile=false")
        if ctx.model.is_moe:
            raise self.invalid("the model has experts (2D TP covers dense layers, as MindSpeed's)", "use 1D TP")
        if ctx.parallel.cp > 1:
            raise self.invalid(f"cp={ctx.parallel.cp} is not covered by 2D TP yet", "use cp=1")

    def apply(self, cfg: Tp2dConfig, ctx: BuildContext) -> list[Change]:
        """Set the grid on the model config (the builder puts the 2D layers in)."""
        return [
            ctx.set_config("tp_x", cfg.tp_x, f"--tp-2d --tp-x {cfg.tp_x}"),
            ctx.set_config("tp_y", cfg.tp_y, f"--tp-2d --tp-y {cfg.tp_y}"),
        ]
