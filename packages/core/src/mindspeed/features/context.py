"""What a feature may read and change: the :class:`BuildContext`.

Features never patch modules or read globals. They read the facts of the run (accelerator,
parallel sizes, model facts) and change three explicit seams, each through a method that
records a :class:`~mindspeed.features.base.Change`:

- ``kernel_impls``: op name -> kernel implementation name of :mod:`mindspeed.ops`. The
  builders (megatron spec, optimizer, our own models) receive them as a value,
  :meth:`BuildContext.kernel_choices` (a :class:`KernelChoices`), and resolve each op with
  ``resolve_kernel(op, kernels.kernel_for(op))``; an op that no feature set means ``"reference"``.
- ``config_overrides``: field name -> value to set on megatron-core's ``TransformerConfig``
  or on our model configs, applied by whoever builds the model.
- ``hooks``: callables the trainer calls at fixed points (see :data:`HOOK_POINTS`).

The mappings are read-only views; only the methods change them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from mindspeed.device import get_accelerator
from mindspeed.features.change import Change, to_jsonable

#: Where a hook can be attached, and what the trainer passes to it.
HOOK_POINTS: dict[str, str] = {
    "post_model_build": "fn(model) after the model is built and parallelized",
    "post_optimizer_build": "fn(optimizer) -> optimizer or None (a wrapper replaces it)",
    "pre_step": "fn(step: int) before each training step",
    "post_step": "fn(step: int) after each training step",
    "pipeline_schedule": "fn(chunks, num_microbatches) -> None or a wrapper of one training pass of the pipeline "
    "schedule (its forward step function and p2p communicator)",
}

#: Owner of changes made outside :func:`~mindspeed.features.apply_features`.
USER = "user"

#: Position-embedding types that use rotary embeddings (megatron-core's names).
ROPE_TYPES = ("rope", "mrope", "yarn")


class KernelChoices(Mapping[str, str]):
    """The kernel implementation of every op, as a value the builders take.

    A read-only mapping of the ops chosen explicitly (op -> implementation name), plus the
    implementation of every other op: ``"reference"`` after features were applied (a feature
    that is off leaves its op on the reference), ``"auto"`` when no features were applied.

    Args:
        impls: op -> implementation name.
        default: the implementation of an op not in ``impls``.
    """

    def __init__(self, impls: Mapping[str, str] | None = None, default: str = "auto") -> None:
        self._impls = dict(impls or {})
        self.default = default

    def kernel_for(self, op: str) -> str:
        """The implementation name to resolve ``op`` with."""
        return self._impls.get(op, self.default)

    def __getitem__(self, op: str) -> str:
        return self._impls[op]

    def __iter__(self) -> Iterator[str]:
        return iter(self._impls)

    def __len__(self) -> int:
        return len(self._impls)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KernelChoices):
            return self._impls == other._impls and self.default == other.default
        return NotImplemented

    def __hash__(self) -> int:
        return hash((tuple(sorted(self._impls.items())), self.default))

    def __repr__(self) -> str:
        return f"KernelChoices({self._impls!r}, default={self.default!r})"

    @classmethod
    def of(cls, kernels: Mapping[str, str] | None) -> KernelChoices:
        """``kernels`` as choices: a :class:`KernelChoices` as is, a mapping with ``"auto"`` for the rest."""
        return kernels if isinstance(kernels, KernelChoices) else cls(kernels, "auto")


@dataclass(frozen=True)
class ParallelSizes:
    """Parallel sizes of the run (read-only facts for ``validate``).

    Attributes:
        tp: tensor-parallel size. pp: pipeline-parallel size. cp: context-parallel size.
        ep: expert-parallel size. dp: data-parallel size. vpp: virtual stages per pipeline rank.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    vpp: int = 1

    def __post_init__(self) -> None:
        for axis, size in asdict(self).items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"parallel size {axis}={size!r} must be a positive integer")


@dataclass(frozen=True)
class ModelFacts:
    """What features need to know about the model; ``None`` means unknown (not checked).

    Attributes:
        normalization: ``"RMSNorm"`` or ``"LayerNorm"`` (megatron-core's names).
        swiglu: whether the MLP is a SwiGLU (gated linear unit with SiLU).
        position_embedding_type: ``"rope"``, ``"mrope"``, ``"yarn"``, ``"learned_absolute"``, ``"none"``.
        num_moe_experts: number of routed experts; 0 for a dense model.
        moe_token_dispatcher_type: ``"allgather"``, ``"alltoall"`` or ``"flex"``.
        attention_features: optional attention-kernel features the model needs
            (``"lse"``, ``"window"``, ``"varlen"``; see :mod:`mindspeed.ops.attention`).
        extra: further facts for features of the suites, by name.
    """

    normalization: str | None = None
    swiglu: bool | None = None
    position_embedding_type: str | None = None
    num_moe_experts: int | None = None
    moe_token_dispatcher_type: str | None = None
    attention_features: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool | None:
        """Whether the model has routed experts (``None``: unknown)."""
        return None if self.num_moe_experts is None else self.num_moe_experts > 0

    @classmethod
    def from_transformer_config(
        cls, config: Any, position_embedding_type: str | None = None, **extra: Any
    ) -> ModelFacts:
        """Facts read from a megatron-core ``TransformerConfig`` (duck-typed: megatron is not imported).

        Args:
            config: the ``TransformerConfig`` (or anything with the same attribute names).
            position_embedding_type: the GPT model's, which ``TransformerConfig`` does not hold.
            extra: more facts for :attr:`extra`.
        """
        activation = getattr(getattr(config, "activation_func", None), "__name__", None)
        gated = getattr(config, "gated_linear_unit", None)
        # Megatron's own recompute, which the layer-recompute features check themselves against,
        # and sequence parallelism, which compute-communication overlap needs.
        for key in ("recompute_granularity", "recompute_method", "recompute_num_layers", "sequence_parallel"):
            extra.setdefault(key, getattr(config, key, None))
        return cls(
            normalization=getattr(config, "normalization", None),
            swiglu=None if gated is None else bool(gated) and activation == "silu",
            position_embedding_type=position_embedding_type,
            num_moe_experts=getattr(config, "num_moe_experts", None) or 0,
            moe_token_dispatcher_type=getattr(config, "moe_token_dispatcher_type", None),
            extra=extra,
        )


class BuildContext:
    """The seams features change, and the facts they read, for one model build.

    Args:
        accelerator: accelerator name (``"cpu"``, ``"cuda"``, ``"npu"``); default: the current one.
        parallel: the parallel sizes (default: all 1).
        model: the model facts (default: all unknown).
    """

    def __init__(
        self, accelerator: str | None = None, parallel: ParallelSizes | None = None, model: ModelFacts | None = None
    ) -> None:
        if accelerator is None:
            accelerator = get_accelerator().name
        self._accelerator = accelerator
        self._parallel = parallel or ParallelSizes()
        self._model = model or ModelFacts()
        self._kernel_impls: dict[str, str] = {}
        self._config_overrides: dict[str, Any] = {}
        self._hooks: dict[str, list[Callable[..., Any]]] = {point: [] for point in HOOK_POINTS}
        self._changes: list[Change] = []
        self._owner = USER
        self.features_applied = False  # set by apply_features: a context takes features once

    # Read-only facts.
    @property
    def accelerator(self) -> str:
        """The accelerator name kernels are resolved for."""
        return self._accelerator

    @property
    def parallel(self) -> ParallelSizes:
        """The parallel sizes."""
        return self._parallel

    @property
    def model(self) -> ModelFacts:
        """The model facts."""
        return self._model

    # Read-only views of the seams.
    @property
    def kernel_impls(self) -> Mapping[str, str]:
        """op -> implementation name set by features (missing ops: ``"reference"``)."""
        return MappingProxyType(self._kernel_impls)

    @property
    def config_overrides(self) -> Mapping[str, Any]:
        """Model-config field -> value."""
        return MappingProxyType(self._config_overrides)

    @property
    def hooks(self) -> Mapping[str, tuple[Callable[..., Any], ...]]:
        """Hook point -> callables, in the order features added them."""
        return MappingProxyType({point: tuple(fns) for point, fns in self._hooks.items()})

    @property
    def changes(self) -> tuple[Change, ...]:
        """Every change made so far, in order."""
        return tuple(self._changes)

    def kernel_for(self, op: str) -> str:
        """The implementation name to resolve ``op`` with: the one a feature set, else ``"reference"``."""
        return self._kernel_impls.get(op, "reference")

    def kernel_choices(self) -> KernelChoices:
        """The kernels chosen so far, as the value the builders take (unset ops: ``"reference"``)."""
        return KernelChoices(self._kernel_impls, default="reference")

    # The only mutations.
    def set_kernel(self, op: str, impl: str, reason: str = "") -> Change:
        """Use implementation ``impl`` (a name in :mod:`mindspeed.ops`) for ``op``."""
        change = self._record(f"kernel_impls.{op}", self.kernel_for(op), impl, reason)
        self._kernel_impls[op] = impl
        return change

    def set_config(self, name: str, value: Any, reason: str = "") -> Change:
        """Override model-config field ``name`` with ``value``."""
        change = self._record(f"config_overrides.{name}", self._config_overrides.get(name), value, reason)
        self._config_overrides[name] = value
        return change

    def add_hook(self, point: str, fn: Callable[..., Any], reason: str = "") -> Change:
        """Attach ``fn`` at hook ``point`` (one of :data:`HOOK_POINTS`).

        Raises:
            ValueError: for an unknown hook point.
        """
        if point not in HOOK_POINTS:
            raise ValueError(f"unknown hook point {point!r}; known: {', '.join(HOOK_POINTS)}")
        before = [to_jsonable(f) for f in self._hooks[point]]
        change = self._record(f"hooks.{point}", before, [*before, to_jsonable(fn)], reason)
        self._hooks[point].append(fn)
        return change

    @contextlib.contextmanager
    def applying(self, feature: str) -> Iterator[None]:
        """Attribute the changes made inside the block to ``feature`` (used by apply_features)."""
        previous, self._owner = self._owner, feature
        try:
            yield
        finally:
            self._owner = previous

    def _record(self, target: str, before: Any, after: Any, reason: str) -> Change:
        change = Change(self._owner, target, before, after, reason)
        self._changes.append(change)
        return change

    def facts(self) -> dict[str, Any]:
        """The read-only facts as plain data (for the report)."""
        return {
            "accelerator": self.accelerator,
            "parallel": asdict(self.parallel),
            "model": to_jsonable(asdict(self.model)),
        }

    def __repr__(self) -> str:
        return f"BuildContext(accelerator={self.accelerator!r}, parallel={self.parallel}, {len(self._changes)} changes)"
