"""``adapt()``: one explicit call after which megatron-core runs unchanged on any accelerator.

On CUDA no device code is touched: only upstream bugs are fixed (those of installs without
Transformer Engine/Apex, and the pipeline-parallel message-order bug that hits NCCL too). On the CPU (gloo) and on Ascend NPUs (hccl) the ``torch.cuda`` calls megatron-core
makes are redirected to the accelerator, CUDA device arguments are rewritten by a
thread-local torch function mode, and a few megatron-core functions with no seam are
replaced. Everything is undone by :func:`unadapt` (or on leaving :func:`adapted`), which
leaves torch and megatron-core exactly as they were.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mindspeed.device import Accelerator, get_accelerator, set_accelerator
from mindspeed.device.cuda_shim import DeviceRedirectMode, cuda_api_patches, needs_cuda_shim, redirect_suspended
from mindspeed.features import BuildContext, apply_features
from mindspeed.features.context import KernelChoices
from mindspeed.log import DETAIL, get_logger, run_log_path
from mindspeed.megatron.active import set_current_report
from mindspeed.megatron.cross_entropy import cross_entropy_patches
from mindspeed.megatron.device_sites import device_site_patches
from mindspeed.megatron.patches import MEGATRON_VERSIONS, megatron_patches
from mindspeed.patching import PatchError, PatchRecord, PatchSet, installed_version

logger = get_logger(__name__)


@dataclass
class AdaptReport:
    """What ``adapt()`` changed: the accelerator, the patches and the features applied.

    It is also the handle the builders take: pass :attr:`kernels` to
    ``get_gpt_layer_spec`` / ``build_model`` / ``build_optimizer`` and
    :attr:`config_overrides` to the ``TransformerConfig``; nothing reads them from a global.

    Attributes:
        accelerator: the accelerator's name. megatron_core: its installed version.
        patches: every patch in place. device_redirect: whether CUDA device arguments are rewritten.
        features: the ``FeatureReport`` (``None`` without features).
        context: the features' ``BuildContext`` (``None`` without features).
        features_config: the ``FeaturesConfig`` applied (``None`` without features).
        kernels: the kernel of every op (``"auto"`` for all without features, else the
            features' choices with ``"reference"`` for the ops no feature chose).
    """

    accelerator: str
    megatron_core: str
    patches: list[PatchRecord] = field(default_factory=list)
    device_redirect: bool = False
    features: Any = None
    context: Any = None
    features_config: Any = None
    kernels: KernelChoices = field(default_factory=KernelChoices)

    @property
    def config_overrides(self) -> dict[str, Any]:
        """``TransformerConfig`` fields the features set (empty without features)."""
        return dict(self.context.config_overrides) if self.context is not None else {}

    @property
    def hooks(self) -> dict[str, tuple]:
        """Hook point -> callables the features attached (empty without features)."""
        return dict(self.context.hooks) if self.context is not None else {}

    def to_dict(self) -> dict[str, Any]:
        """Plain data for run reports."""
        return {
            "accelerator": self.accelerator,
            "megatron_core": self.megatron_core,
            "device_redirect": self.device_redirect,
            "patches": [vars(p) for p in self.patches],
            "features": self.features.to_dict() if hasattr(self.features, "to_dict") else self.features,
        }

    def summary(self) -> str:
        """One line: the version, the accelerator, how many patches and which features."""
        features = getattr(self.features, "enabled", None)
        where = run_log_path()
        return (
            f"adapted megatron-core {self.megatron_core} to {self.accelerator}: {len(self.patches)} patches"
            + (f", features {', '.join(features) or 'none'}" if features is not None else "")
            + (f" (the list: {where})" if where is not None else " (the list: --verbose)")
        )

    def describe(self) -> str:
        """Human-readable report, one patch per line."""
        lines = [
            f"adapted megatron-core {self.megatron_core} to {self.accelerator}"
            f" ({len(self.patches)} patches, device redirect {'on' if self.device_redirect else 'off'})"
        ]
        lines += [f"  - {p.name}: {p.target} [{p.distribution}{p.versions}] {p.reason}" for p in self.patches]
        if self.features is not None and hasattr(self.features, "render"):
            lines.append(self.features.render())
        return "\n".join(lines)


class _RngWarningFilter(logging.Filter):
    # On a host, the "GPU" generator is the CPU generator, so megatron's tracker warns on every
    # fork that the CPU state changed; the states are still restored correctly.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


@dataclass
class _Adaptation:
    report: AdaptReport
    patches: PatchSet
    mode: DeviceRedirectMode | None
    thread: int
    rng_filter: _RngWarningFilter


_active: _Adaptation | None = None
_lock = threading.Lock()


def check_megatron_version() -> str:
    """The installed megatron-core version; raises if it is outside the supported range."""
    version = installed_version("megatron-core")
    if version is None:
        raise PatchError("megatron-core is not installed; install mindspeed-core's dependencies")
    from packaging.specifiers import SpecifierSet

    if version not in SpecifierSet(MEGATRON_VERSIONS):
        raise PatchError(
            f"megatron-core {version} is installed but the adaptor supports {MEGATRON_VERSIONS}; "
            f"install a supported version (pip install 'megatron-core{MEGATRON_VERSIONS}')"
        )
    return str(version)


def adapt(
    accelerator: str | Accelerator | None = None, features: Any = None, model: Any = None, parallel: Any = None
) -> AdaptReport:
    """Make megatron-core run on ``accelerator`` (default: the detected one).

    Args:
        accelerator: an accelerator name or object; ``None`` uses ``get_accelerator()``.
        features: a ``mindspeed.features.FeaturesConfig`` to apply; ``None`` applies none.
            The report's ``kernels`` and ``config_overrides`` carry its choices to the builders.
        model: ``mindspeed.features.ModelFacts`` the features validate against (e.g. from
            ``ModelFacts.from_transformer_config(config)``).
        parallel: ``mindspeed.features.ParallelSizes`` of the run.

    Returns:
        The report of everything changed (also logged).

    Raises:
        PatchError: megatron-core or torch outside the versions the patches were written for.
        RuntimeError: if already adapted (call :func:`unadapt` first).
    """
    global _active
    with _lock:
        if _active is not None:
            raise RuntimeError("megatron-core is already adapted; call unadapt() first or use adapted()")
        acc = set_accelerator(accelerator) if accelerator is not None else get_accelerator()
        version = check_megatron_version()
        import megatron.core  # noqa: F401  (fail here, with its own message, if it cannot import)

        patches = PatchSet([*cuda_api_patches(), *megatron_patches(), *device_site_patches(), *cross_entropy_patches()])
        records = patches.apply(acc)
        mode = None
        if needs_cuda_shim(acc):
            mode = DeviceRedirectMode(acc)
            mode.__enter__()
        rng_filter = _RngWarningFilter()
        logging.getLogger("megatron.core.tensor_parallel.random").addFilter(rng_filter)
        report = AdaptReport(
            accelerator=acc.name, megatron_core=version, patches=records, device_redirect=mode is not None
        )
        _active = _Adaptation(report, patches, mode, threading.get_ident(), rng_filter)
        set_current_report(report)
    if features is not None:
        try:
            _apply_features(report, features, acc, model, parallel)
        except Exception:
            unadapt()
            raise
    # The console gets one line; the patch list and the features table are detail (the run log).
    logger.info("%s", report.summary())
    logger.info("%s", report.describe(), extra=DETAIL)
    return report


def _apply_features(report: AdaptReport, features: Any, acc: Accelerator, model: Any, parallel: Any) -> None:
    # Lazy: spec and moe import megatron-core, which importing mindspeed.megatron must not do.
    from mindspeed.megatron.grad_accum import gradient_accumulation_fusion_patches
    from mindspeed.megatron.moe import moe_permute_patches
    from mindspeed.megatron.spec import rotary_patch

    ctx = BuildContext(accelerator=acc.name, parallel=parallel, model=model)
    report.features = apply_features(features, ctx)
    report.context = ctx
    report.features_config = features
    report.kernels = ctx.kernel_choices()
    if "matmul_add_fp32" in ctx.kernel_impls:
        # megatron's gradient_accumulation_fusion calls Apex's fused_weight_gradient_mlp_cuda by
        # module name: the registry kernel goes in there (the feature turns the config flag on).
        for patch in gradient_accumulation_fusion_patches(ctx.kernel_for("matmul_add_fp32")):
            report.patches.append(_active.patches.add(patch, acc))
    if "rotary_pos_emb" in ctx.kernel_impls:
        # megatron-core has no spec seam for RoPE: the feature's kernel goes in by a patch.
        report.patches.append(_active.patches.add(rotary_patch(ctx.kernel_impls["rotary_pos_emb"]), acc))
    if "moe_permute" in ctx.kernel_impls or "moe_unpermute" in ctx.kernel_impls:
        # The token dispatchers have no seam either: moe_permute_fusion's kernels go in by patches.
        for patch in moe_permute_patches(ctx.kernel_for("moe_permute"), ctx.kernel_for("moe_unpermute")):
            report.patches.append(_active.patches.add(patch, acc))


@contextlib.contextmanager
def fast_path() -> Iterator[None]:
    """Run megatron-core's training step (forward, backward, optimizer step) without the device redirect.

    ``adapt()`` patches the step's call sites that name CUDA (``mindspeed.megatron.device_sites``),
    so inside this block torch calls dispatch straight to their kernels instead of through a
    Python torch function mode (~1,300 hops per step of the tiny GPT). Setup (building the
    model and optimizer, checkpoints) stays outside it. A no-op on CUDA and when not adapted.
    """
    with redirect_suspended():
        yield


def enter_thread() -> None:
    """Enter the device redirect in the calling thread (function modes are thread-local).

    Call it at the start of any extra thread that runs megatron-core code.
    """
    if _active is not None and _active.mode is not None and threading.get_ident() != _active.thread:
        DeviceRedirectMode(_active.mode.accelerator).__enter__()


def unadapt() -> None:
    """Undo :func:`adapt`: revert every patch and leave the device redirect.

    Must be called from the thread that called ``adapt()``.
    """
    global _active
    with _lock:
        if _active is None:
            return
        if _active.mode is not None:
            if threading.get_ident() != _active.thread:
                raise RuntimeError("unadapt() must run in the thread that called adapt()")
            _active.mode.__exit__(None, None, None)
        _active.patches.revert()
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_active.rng_filter)
        _active = None
        set_current_report(None)


@contextlib.contextmanager
def adapted(accelerator: str | Accelerator | None = None, features: Any = None) -> Iterator[AdaptReport]:
    """``with adapted(): ...`` adapts for the block and undoes it afterwards."""
    report = adapt(accelerator, features)
    try:
        yield report
    finally:
        unadapt()
