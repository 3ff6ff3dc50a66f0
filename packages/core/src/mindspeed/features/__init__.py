"""Features: MindSpeed's feature units, applied by an explicit call instead of import-time patches.

A feature (fused RMSNorm, flash attention, ...) is a small class that owns its config,
optimization level, flags, requirements, conflicts, validation and changes. Nothing happens
until a builder calls :func:`apply_features`::

    from mindspeed.features import BuildContext, FeaturesConfig, ModelFacts, apply_features

    ctx = BuildContext(model=ModelFacts(normalization="RMSNorm", swiglu=True))
    report = apply_features(FeaturesConfig(optimization_level=1), ctx)
    ctx.kernel_impls        # {"rms_norm": "native", ...}: what the model builder resolves
    report.write("run/features.json")

Importing this package registers the features listed below into :data:`FEATURES` and does
nothing else.
"""

from mindspeed.features import coc, context_parallel, kernels, memory, moe, pipeline, position, ripipe, tp2d
from mindspeed.features.base import FEATURES, LEVELS, Change, Feature, FeatureConfig, register_feature
from mindspeed.features.context import HOOK_POINTS, BuildContext, KernelChoices, ModelFacts, ParallelSizes
from mindspeed.features.manager import FeaturesConfig, apply_features, order_features, resolve_features
from mindspeed.features.report import FeatureReport, FeatureStatus

# The manifest: every feature of the core, in listing order. A new feature is a class in a
# module of this package plus one line here.
_MANIFEST: tuple[type[Feature], ...] = (
    kernels.FusedRMSNormFeature,
    kernels.FusedSwiGLUFeature,
    kernels.FusedRotaryPosEmbFeature,
    kernels.FlashAttnFeature,
    position.AlibiFeature,
    kernels.FusedAdamWFeature,
    kernels.GradientAccumulationFusionFeature,
    kernels.MoEGroupedGemmFeature,
    kernels.MoEPermuteFusionFeature,
    moe.MoETpExtendEpFeature,
    moe.MoESharedExpertsFeature,
    moe.MoELoadBalancingFeature,
    moe.MoEExpertBiasFeature,
    moe.MoEExpertLoadMetricsFeature,
    context_parallel.ContextParallelFeature,
    coc.CoCFeature,
    tp2d.Tp2dFeature,
    pipeline.NoopLayersFeature,
    pipeline.DualPipeVFeature,
    *memory.MEMORY_FEATURES,
    *ripipe.RIPIPE_FEATURES,
)

for _feature in _MANIFEST:
    register_feature(_feature)
del _feature

__all__ = [
    "FEATURES",
    "HOOK_POINTS",
    "LEVELS",
    "BuildContext",
    "Change",
    "Feature",
    "FeatureConfig",
    "FeatureReport",
    "FeatureStatus",
    "FeaturesConfig",
    "KernelChoices",
    "ModelFacts",
    "ParallelSizes",
    "apply_features",
    "order_features",
    "register_feature",
    "resolve_features",
]
