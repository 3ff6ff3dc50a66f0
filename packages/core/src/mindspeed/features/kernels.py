"""Level-1 features: device-affine kernels picked from the :mod:`mindspeed.ops` registry.

Each feature stands for one MindSpeed / Megatron fused-kernel flag and sets
``ctx.kernel_impls[op]`` for its op(s) to the implementation ``resolve_kernel(op, impl)``
picks on ``ctx.accelerator``. It is on by default only where ``impl="auto"`` would pick
something faster than the reference there (and the model facts do not rule it out);
turned off, the op stays on its reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import ROPE_TYPES, BuildContext
from mindspeed.ops import OPS, available_kernels, resolve_kernel


@dataclass
class KernelConfig(FeatureConfig):
    """Settings of a kernel feature.

    Attributes:
        enabled: see :class:`FeatureConfig`.
        impl: ``"auto"`` (the best available on the accelerator), ``"reference"``, or an
            implementation name of the op (``mindspeed info`` lists them).
    """

    impl: str = "auto"


class KernelFeature(Feature):
    """A feature that selects registry kernels for ``ops``; subclasses add model checks.

    Attributes:
        ops: the op names in :mod:`mindspeed.ops` the feature selects kernels for.
    """

    Config = KernelConfig
    level = 1
    ops: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        if "targets" not in cls.__dict__:
            cls.targets = tuple(f"kernel_impls.{op}" for op in cls.ops)
        super().__init_subclass__(**kwargs)

    def kernel_features(self, ctx: BuildContext) -> tuple[str, ...]:
        """Optional op features the chosen kernel must support (none by default)."""
        return ()

    def model_problem(self, ctx: BuildContext) -> tuple[str, str] | None:
        """``(problem, fix)`` when the model facts rule the feature out, else ``None``.

        Unknown facts (``None``) never rule a feature out.
        """
        return None

    def default_enabled(self, ctx: BuildContext) -> bool:
        """On where the model allows it and ``auto`` beats the reference for every op."""
        if self.model_problem(ctx) is not None:
            return False
        features = self.kernel_features(ctx)
        return all(available_kernels(op, ctx.accelerator, features)[0].name != "reference" for op in self.ops)

    def why_off_by_default(self, ctx: BuildContext) -> str:
        """The model fact that rules it out, or the ops with nothing faster than the reference here."""
        problem = self.model_problem(ctx)
        if problem is not None:
            return problem[0]
        features = self.kernel_features(ctx)
        slow = [op for op in self.ops if available_kernels(op, ctx.accelerator, features)[0].name == "reference"]
        return f"no kernel faster than the reference for {', '.join(slow)} on {ctx.accelerator}"

    def validate(self, cfg: KernelConfig, ctx: BuildContext) -> None:
        """Check the model facts and that ``cfg.impl`` resolves on ``ctx.accelerator``."""
        problem = self.model_problem(ctx)
        if problem is not None:
            raise self.invalid(*problem)
        for op in self.ops:
            OPS.get(op)  # a feature naming an op that is not registered is a defect; fail loudly
            self._resolve(op, cfg, ctx)

    def apply(self, cfg: KernelConfig, ctx: BuildContext) -> list[Change]:
        """Set ``kernel_impls[op]`` for every op to the resolved implementation."""
        return [
            ctx.set_kernel(op, self._resolve(op, cfg, ctx), reason=f"impl={cfg.impl!r} on {ctx.accelerator}")
            for op in self.ops
        ]

    def _resolve(self, op: str, cfg: KernelConfig, ctx: BuildContext) -> str:
        try:
            return resolve_kernel(op, cfg.impl, device=ctx.accelerator, features=self.kernel_features(ctx)).name
        except ValueError as err:
            raise self.invalid(
                f"settings.{self.name}.impl={cfg.impl!r}: {err}",
                f"set settings.{self.name}.impl to 'auto' or an implementation listed there",
            ) from None


class FusedRMSNormFeature(KernelFeature):
    """``--use-fused-rmsnorm``: the RMSNorm kernel of the accelerator."""

    name = "fused_rmsnorm"
    flags = ("--use-fused-rmsnorm",)
    ops = ("rms_norm",)
    description = "fused RMSNorm kernel (needs normalization RMSNorm)"

    def model_problem(self, ctx: BuildContext) -> tuple[str, str] | None:
        norm = ctx.model.normalization
        if norm is not None and norm != "RMSNorm":
            return (
                f"the model's normalization is {norm!r}, but the fused kernel computes RMSNorm",
                "use normalization RMSNorm",
            )
        return None


class FusedSwiGLUFeature(KernelFeature):
    """``--use-fused-swiglu``: the SwiGLU activation kernel of the accelerator."""

    name = "fused_swiglu"
    flags = ("--use-fused-swiglu",)
    ops = ("swiglu",)
    description = "fused SwiGLU activation (needs a SwiGLU MLP)"

    def model_problem(self, ctx: BuildContext) -> tuple[str, str] | None:
        if ctx.model.swiglu is False:
            return ("the model's MLP is not a SwiGLU", "use a gated linear unit with SiLU (--swiglu)")
        return None


class FusedRotaryPosEmbFeature(KernelFeature):
    """``--use-fused-rotary-pos-emb``: the rotary-embedding kernel of the accelerator."""

    name = "fused_rotary_pos_emb"
    flags = ("--use-fused-rotary-pos-emb",)
    ops = ("rotary_pos_emb",)
    description = "fused rotary position embedding (needs a rotary position embedding)"

    def model_problem(self, ctx: BuildContext) -> tuple[str, str] | None:
        kind = ctx.model.position_embedding_type
        if kind is not None and kind not in ROPE_TYPES:
            return (
                f"the model's position_embedding_type is {kind!r}, not a rotary one",
                f"use one of {', '.join(ROPE_TYPES)}",
            )
        return None


class FlashAttnFeature(KernelFeature):
    """``--use-flash-attn``: a memory-efficient attention kernel supporting the model's attention features."""

    name = "flash_attn"
    flags = ("--use-flash-attn",)
    ops = ("attention",)
    description = "memory-efficient fused attention (flash-attn, SDPA, npu_fusion_attention)"

    def kernel_features(self, ctx: BuildContext) -> tuple[str, ...]:
        # The model says what it calls attention with (sliding window, packed sequences, lse for ring CP).
        return tuple(ctx.model.attention_features)


class FusedAdamWFeature(KernelFeature):
    """``--optimizer-selection fused_adamw``: a fused or multi-tensor AdamW step."""

    name = "fused_adamw"
    flags = ("--optimizer-selection fused_adamw",)
    ops = ("adamw",)
    description = "fused multi-tensor AdamW step"


class GradientAccumulationFusionFeature(KernelFeature):
    """``--gradient-accumulation-fusion``: weight-gradient GEMM fused with the fp32 accumulation.

    Sets the kernel and megatron's ``TransformerConfig.gradient_accumulation_fusion``: the
    backward of megatron's linear layers then accumulates ``grad_output^T @ input`` into the
    parameter's ``main_grad`` through the kernel (``mindspeed.megatron.grad_accum``, put in
    by ``adapt()``) instead of materialising the weight gradient and adding it afterwards.
    """

    name = "gradient_accumulation_fusion"
    flags = ("--gradient-accumulation-fusion",)
    ops = ("matmul_add_fp32",)
    description = "weight-gradient GEMM accumulated into the fp32 main_grad in one kernel"
    targets = ("kernel_impls.matmul_add_fp32", "config_overrides.gradient_accumulation_fusion")

    def apply(self, cfg: KernelConfig, ctx: BuildContext) -> list[Change]:
        """The kernel, and megatron's flag that routes the linear layers' weight gradients to it."""
        return [
            *super().apply(cfg, ctx),
            ctx.set_config("gradient_accumulation_fusion", True, reason="weight gradients into main_grad"),
        ]

    def model_problem(self, ctx: BuildContext) -> tuple[str, str] | None:
        if ctx.model.extra.get("compiled_layers"):
            # Its backward assigns and accumulates ``weight.main_grad`` in place, a side effect dynamo
            # refuses inside the compiled layer's autograd.Function (megatron's linear layers).
            return (
                "train.compile traces the layers, and this backward mutates weight.main_grad in place",
                "set train.compile=false to fuse the weight-gradient accumulation",
            )
        return None


class MoEFeature(KernelFeature):
    """A kernel feature for MoE layers: ruled out on a model known to be dense."""

    def model_problem(self, ctx: BuildContext) -> tuple[str, str] | None:
        if ctx.model.is_moe is False:
            return ("the model has no routed experts (num_moe_experts=0)", "use it with a MoE model")
        return None


class MoEGroupedGemmFeature(MoEFeature):
    """``--moe-grouped-gemm``: one grouped GEMM over the local experts."""

    name = "moe_grouped_gemm"
    flags = ("--moe-grouped-gemm",)
    ops = ("grouped_matmul",)
    description = "one grouped GEMM over all local experts instead of a loop"


class MoEPermuteFusionFeature(MoEFeature):
    """``--moe-permute-fusion``: fused token permute/unpermute for the all-to-all dispatchers."""

    name = "moe_permute_fusion"
    flags = ("--moe-permute-fusion", "--use-fused-moe-token-permute-and-unpermute")
    ops = ("moe_permute", "moe_unpermute")
    description = "fused MoE token permute/unpermute (not with the allgather dispatcher)"

    def model_problem(self, ctx: BuildContext) -> tuple[str, str] | None:
        if ctx.model.moe_token_dispatcher_type == "allgather":
            # As in MindSpeed: the fused permutation kernels serve the all-to-all dispatchers only.
            return (
                "moe_token_dispatcher_type is 'allgather', which the fused permutation does not support",
                "use moe_token_dispatcher_type 'alltoall'",
            )
        return super().model_problem(ctx)


#: The kernel features, in the order the manifest registers them.
KERNEL_FEATURES: tuple[type[KernelFeature], ...] = (
    FusedRMSNormFeature,
    FusedSwiGLUFeature,
    FusedRotaryPosEmbFeature,
    FlashAttnFeature,
    FusedAdamWFeature,
    GradientAccumulationFusionFeature,
    MoEGroupedGemmFeature,
    MoEPermuteFusionFeature,
)
