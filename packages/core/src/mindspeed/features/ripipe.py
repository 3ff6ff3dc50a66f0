"""``--recompute-in-bubble``: recompute scheduled by megatron's interleaved schedule into its bubbles.

MindSpeed's recompute-independent pipelining (``recompute_independent_pipelining.md``). The
work is :mod:`mindspeed.memory.ripipe`; this module owns the flag, its checks and its hook.
MindSpeed's second flag, ``--recompute-in-advance``, is not here (docs/core/memory.md says why).
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import BuildContext
from mindspeed.memory.ripipe import RecomputeInBubble


@dataclass
class RecomputeInBubbleConfig(FeatureConfig):
    """Settings of the in-bubble recompute.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        kept_chunks: chunk-forwards per rank that keep their activations until their backward;
            ``None``: ``pp * vpp`` (MindSpeed's bound). Smaller saves more and recomputes more.
    """

    kept_chunks: int | None = None


class RecomputeInBubbleFeature(Feature):
    """``--recompute-in-bubble``: at most ``kept_chunks`` chunk-forwards per rank hold activations.

    The others keep only their inputs (saved-tensor hooks) and are recomputed by the schedule
    before the rank waits for the next stage's gradient, so the backward finds them ready.
    Needs the interleaved schedule (``vpp > 1``) and no recompute of megatron's (MindSpeed's
    rule: the feature replaces it); refuses MoE models, whose auxiliary-loss trackers a second
    forward would count twice. Training is bit-identical to the run without it.
    """

    name = "recompute_in_bubble"
    Config = RecomputeInBubbleConfig
    level = 2
    flags = ("--recompute-in-bubble",)
    description = "chunk-forwards beyond pp*vpp keep only inputs; recomputed in the pipeline bubble (interleaved 1F1B)"
    targets = ("hooks.pipeline_schedule",)

    def validate(self, cfg: RecomputeInBubbleConfig, ctx: BuildContext) -> None:
        """VPP, no megatron recompute, dense, a positive bound."""
        if ctx.parallel.vpp < 2:
            raise self.invalid(
                f"it needs the interleaved schedule, the run has vpp={ctx.parallel.vpp}",
                "set parallel.vpp >= 2 (with pp >= 2)",
            )
        granularity = ctx.model.extra.get("recompute_granularity")
        if granularity is not None:
            raise self.invalid(
                f"megatron's {granularity} recompute is on, which this feature replaces",
                "unset model.recompute_granularity",
            )
        if ctx.model.is_moe:
            raise self.invalid("a recomputed MoE forward counts its auxiliary losses twice", "use it on dense models")
        if cfg.kept_chunks is not None and cfg.kept_chunks < 1:
            raise self.invalid(f"kept_chunks={cfg.kept_chunks} is not positive", "use kept_chunks >= 1 or null")

    def apply(self, cfg: RecomputeInBubbleConfig, ctx: BuildContext) -> list[Change]:
        """Wrap each training pass of the schedule."""
        bound = cfg.kept_chunks if cfg.kept_chunks is not None else ctx.parallel.pp * ctx.parallel.vpp
        hook = RecomputeInBubble(cfg.kept_chunks)
        return [ctx.add_hook("pipeline_schedule", hook.for_pass, f"at most {bound} chunk-forwards keep activations")]


#: The features of this module.
RIPIPE_FEATURES: tuple[type[Feature], ...] = (RecomputeInBubbleFeature,)
