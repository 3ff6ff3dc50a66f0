"""Position-embedding features: ALiBi (MindSpeed's ``--position-embedding-type alibi``).

A model whose shape says ``position_embedding_type="alibi"`` (BLOOM, Baichuan-13B, MPT) has no
rotary or learned position embedding: every attention layer adds the ALiBi bias to its scores
(:mod:`mindspeed.ops.alibi`). The layer spec puts the slopes into
:class:`~mindspeed.megatron.modules.RegistryAttention` (each tensor-parallel rank the slopes of
its heads); this feature checks what the run can do with it and picks an attention kernel that
takes ``alibi_slopes``.
"""

from __future__ import annotations

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import BuildContext
from mindspeed.ops import resolve_kernel
from mindspeed.ops.attention import FEATURE_ALIBI

ALIBI = "alibi"


class AlibiFeature(Feature):
    """ALiBi attention biases, on whenever the model's position embedding is ``alibi``.

    The model facts may carry ``extra["num_attention_heads"]``; then the heads are checked
    against the tensor-parallel size (each rank takes whole heads and their slopes).
    """

    name = "alibi"
    level = 0
    flags = ("--position-embedding-type alibi",)
    description = "ALiBi linear attention biases (slopes per head, sharded with tensor-parallel heads)"
    targets = ("kernel_impls.attention",)

    def default_enabled(self, ctx: BuildContext) -> bool:
        """On exactly when the model's position embedding is ALiBi (it is the model, not a choice)."""
        return ctx.model.position_embedding_type == ALIBI

    def why_off_by_default(self, ctx: BuildContext) -> str:
        """The model has another position embedding."""
        return f"the model's position embedding is {ctx.model.position_embedding_type!r}, not 'alibi'"

    def validate(self, cfg: FeatureConfig, ctx: BuildContext) -> None:
        """An ALiBi model with heads that the tensor-parallel size divides.

        Context parallelism is checked where its algorithm is known: the attention layers take
        the ring (and double ring), Ulysses, KV all-gather and adaptive CP, and refuse hybrid at
        build time.
        """
        kind = ctx.model.position_embedding_type
        if kind is not None and kind != ALIBI:
            raise self.invalid(
                f"the model's position_embedding_type is {kind!r}", "use position_embedding_type 'alibi'"
            )
        heads = ctx.model.extra.get("num_attention_heads")
        if heads is not None and int(heads) % ctx.parallel.tp:
            raise self.invalid(
                f"{heads} attention heads do not split over tp={ctx.parallel.tp}", "use a tp that divides the heads"
            )

    def apply(self, cfg: FeatureConfig, ctx: BuildContext) -> list[Change]:
        """Keep the attention kernel chosen so far if it takes ``alibi_slopes``, else the best one that does."""
        current = ctx.kernel_for("attention")
        features = tuple(sorted({*ctx.model.attention_features, FEATURE_ALIBI}))
        try:
            impl = resolve_kernel("attention", current, device=ctx.accelerator, features=features).name
            reason = f"{current!r} takes alibi_slopes"
        except ValueError:
            impl = resolve_kernel("attention", "auto", device=ctx.accelerator, features=features).name
            reason = f"{current!r} has no ALiBi: best kernel with {list(features)} on {ctx.accelerator}"
        return [ctx.set_kernel("attention", impl, reason=f"ALiBi slopes in every attention layer; {reason}")]
