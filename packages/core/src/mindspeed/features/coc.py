"""Compute-communication overlap (MindSpeed's CoC, ``--use-ascend-coc``; its MC2 kernels, ``--use-ascend-mc2``).

Under tensor + sequence parallelism the column-parallel linears all-gather their input along the
sequence before the GEMM and the row-parallel linears reduce-scatter after it; without sequence
parallelism the row-parallel linears all-reduce after it. With this feature the layer spec builds
them as :mod:`mindspeed.megatron.coc`'s linears, which run the pairs as the registry ops
``all_gather_matmul`` / ``matmul_reduce_scatter`` / ``matmul_all_reduce``: the ``chunked``
pipeline of ``coc_parallel_num`` sequence chunks (MindSpeed's script-side CoC), or with
``coc_fused_kernel`` the vendor kernel that fuses the pair (the Ascend extension's ``npu_all_gather_base_mm`` /
``npu_mm_reduce_scatter_base`` / ``npu_mm_all_reduce_base``: MindSpeed's fused CoC and MC2 kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mindspeed.features.base import Change, Feature, FeatureConfig
from mindspeed.features.context import BuildContext
from mindspeed.ops import available_kernels

COC_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
#: The ops a run uses: with sequence parallelism the gather / reduce-scatter pair, without it the all-reduce.
SP_OPS, TP_OPS = COC_OPS[:2], COC_OPS[2:]
#: The device-agnostic implementations; any other one of the ops is a vendor kernel fusing the pair.
UNFUSED = ("reference", "chunked")


def fused_kernel(op: str, accelerator: str) -> str | None:
    """The best available vendor kernel of ``op`` on ``accelerator`` (``None``: there is none)."""
    fused = [impl.name for impl in available_kernels(op, accelerator) if impl.name not in UNFUSED]
    return fused[0] if fused else None


@dataclass
class CoCConfig(FeatureConfig):
    """Knobs: ``coc_parallel_num`` (sequence chunks of the pipeline, MindSpeed's 2/4/8) and
    ``coc_fused_kernel`` (the vendor's fused matmul + collective kernel instead of the pipeline)."""

    coc_parallel_num: int = 2
    coc_fused_kernel: bool = False


class CoCChunks:
    """``post_model_build`` hook: set the pipeline depth of every CoC linear of the model chunks."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks

    def __call__(self, model: Any) -> None:
        # Duck-typed (the layers' ``coc_num_chunks``): the features do not import the megatron adaptor.
        for chunk in model if isinstance(model, (list, tuple)) else [model]:
            for module in chunk.modules():
                if hasattr(module, "coc_num_chunks"):
                    module.coc_num_chunks = self.num_chunks

    def __repr__(self) -> str:
        return f"CoCChunks({self.num_chunks})"


class CoCFeature(Feature):
    """The TP linears' collectives overlapped with their GEMMs, chunk by chunk (or fused by the vendor)."""

    name = "coc"
    Config = CoCConfig
    level = 2
    flags = ("--use-ascend-coc", "--coc-parallel-num", "--coc-fused-kernel", "--use-ascend-mc2")
    description = (
        "TP linears: all-gather/reduce-scatter/all-reduce overlapped with the GEMM in sequence chunks (MC2 fused)"
    )
    targets = (*(f"kernel_impls.{op}" for op in COC_OPS), "hooks.post_model_build")

    def validate(self, cfg: CoCConfig, ctx: BuildContext) -> None:
        """TP > 1, a positive chunk count, the fused kernel only where it exists."""
        if ctx.parallel.tp < 2:
            raise self.invalid(
                f"it overlaps the collectives of TP's linears, and the run has tp={ctx.parallel.tp}",
                "use parallel.tp >= 2 (with or without parallel.sequence_parallel)",
            )
        if ctx.model.extra.get("compiled_layers"):
            # not traced yet: their collectives are async / chunked inside autograd.Functions (docs/llm/pretrain.md)
            raise self.invalid("train.compile does not trace CoC's chunked linears yet", "set train.compile=false")
        if cfg.coc_parallel_num < 1:
            raise self.invalid(f"settings.coc.coc_parallel_num={cfg.coc_parallel_num}", "use 1, 2, 4 or 8")
        if cfg.coc_fused_kernel:
            for op in self.ops(ctx):
                if fused_kernel(op, ctx.accelerator) is None:
                    raise self.invalid(
                        f"no fused {op} kernel registered for {ctx.accelerator}",
                        "set coc_fused_kernel=false (the chunked pipeline)",
                    )

    @staticmethod
    def ops(ctx: BuildContext) -> tuple[str, ...]:
        """The ops the run's linears call (all three where the model does not say whether it runs SP)."""
        sp = ctx.model.extra.get("sequence_parallel")
        return COC_OPS if sp is None else SP_OPS if sp else TP_OPS

    def apply(self, cfg: CoCConfig, ctx: BuildContext) -> list[Change]:
        """Choose the ops' kernels (the spec then builds the CoC linears) and set the chunk count."""
        why = "--coc-fused-kernel" if cfg.coc_fused_kernel else f"--coc-parallel-num {cfg.coc_parallel_num}"
        changes = []
        for op in self.ops(ctx):
            impl = fused_kernel(op, ctx.accelerator) if cfg.coc_fused_kernel else "chunked"
            changes.append(ctx.set_kernel(op, impl, reason=f"--use-ascend-coc: {why}"))
        hook = CoCChunks(cfg.coc_parallel_num)
        changes.append(ctx.add_hook("post_model_build", hook, f"{cfg.coc_parallel_num} sequence chunks per linear"))
        return changes
