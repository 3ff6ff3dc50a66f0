"""Output-discarding recompute of the MLP activation and the norms in megatron-core layers.

A plain checkpoint keeps a block's output alive until the backward reaches the block, because
the next module saved it for its own backward. The output-discarding checkpoint (megatron-core's
``CheckpointWithoutOutput``, MindSpeed's ``--recompute-activation-function`` /
``--recompute-norm``) runs a *producer* module without autograd, keeps only its input, frees the
output's storage as soon as the *consumer* module has run (the tensor object stays, so the
consumer's saved reference is still valid) and recomputes the output into that same storage
from a gradient hook on the consumer's output, i.e. just before the consumer's backward needs
it. The numbers are the ones of the run without it: the same kernel runs on the same input
under the same RNG state, and the consumer reads the same storage.

Pairs (producer -> consumer) in a megatron ``TransformerLayer``:

- activation: ``mlp.activation_func`` -> ``mlp.linear_fc2`` of every megatron ``MLP`` in the
  layer (dense MLP, shared experts, ``SequentialMLP`` experts); the activation must be a module
  (the registry spec's ``RegistrySwiGLU``: ``use_te_activation_func=True``). The registry's grouped
  experts (``RegistryGroupedMLP``) have the same mechanism built in and are switched on.
- norms: ``input_layernorm`` -> ``self_attention`` and ``pre_mlp_layernorm`` -> ``mlp``.

Nothing is patched and no parameter moves: the producer's ``forward`` is shadowed on the
instance and a forward hook sits on the consumer, both removed by :meth:`RecomputePairs.remove`.
Which layers: the first ``num_layers`` of each pipeline stage, counted over its virtual stages
as MindSpeed does (local layer ``i`` of virtual stage ``v`` of ``V`` has priority ``i * V + v``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: The producer -> consumer pairs of a layer for each kind of recompute.
ACTIVATION = "activation"
NORM = "norm"
KINDS = (ACTIVATION, NORM)


def transformer_layers(chunks: Iterable[nn.Module]) -> list[tuple[int, int, nn.Module]]:
    """``(virtual stage, local index, layer)`` of every megatron ``TransformerLayer`` in ``chunks``."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    chunks = list(chunks)
    found = []
    for stage, chunk in enumerate(chunks):
        layers = [m for m in chunk.modules() if isinstance(m, TransformerLayer)]
        found += [(stage, index, layer) for index, layer in enumerate(layers)]
    return found


def select_layers(chunks: Iterable[nn.Module], num_layers: int | None) -> list[nn.Module]:
    """The layers of this pipeline stage that get recompute: the first ``num_layers`` (``None``: all).

    Local layer ``i`` of virtual stage ``v`` (of ``V`` on this rank) has priority ``i * V + v``;
    the layers of priority below ``num_layers`` are chosen (MindSpeed's order).
    """
    chunks = list(chunks)
    layers = transformer_layers(chunks)
    if num_layers is None:
        return [layer for _, _, layer in layers]
    return [layer for stage, index, layer in layers if index * len(chunks) + stage < num_layers]


class _Discarding:
    """One producer -> consumer pair: checkpoint the producer, discard its output after the consumer."""

    def __init__(self, producer: nn.Module, consumer: nn.Module) -> None:
        from megatron.core.tensor_parallel import CheckpointWithoutOutput

        self._checkpoint_class = CheckpointWithoutOutput
        self.producer, self.consumer = producer, consumer
        self._pending: Any = None
        self.discarded = 0  # outputs freed so far (for tests and the report)
        forward = type(producer).forward.__get__(producer)

        def discarding_forward(*args: Any, **kwargs: Any) -> Any:
            if kwargs or not torch.is_grad_enabled() or not producer.training:
                return forward(*args, **kwargs)
            # fp8=None: megatron-core 0.16 stores ``fp8 is not None``, so its default (False)
            # would take the Transformer Engine path; None means no fp8 either way.
            checkpoint = self._checkpoint_class(fp8=None)
            out = checkpoint.checkpoint(forward, *args)
            self._pending = checkpoint
            return out

        producer.forward = discarding_forward  # shadows the class method on this instance only
        self._hook = consumer.register_forward_hook(self._after_consumer)

    def _after_consumer(self, module: nn.Module, args: Any, output: Any) -> None:
        checkpoint, self._pending = self._pending, None
        if checkpoint is None:
            return
        hook_tensor = output[0] if isinstance(output, (tuple, list)) else output
        checkpoint.discard_output_and_register_recompute(hook_tensor)
        self.discarded += 1

    def remove(self) -> None:
        """Give the producer its class ``forward`` back and drop the consumer's hook."""
        self.producer.__dict__.pop("forward", None)
        self._hook.remove()


@dataclass
class RecomputePairs:
    """The pairs one :func:`recompute_activation` / :func:`recompute_norm` call installed.

    Attributes:
        kind: ``"activation"`` or ``"norm"``.
        layers: how many layers got it.
        pairs: the installed producer -> consumer pairs.
        grouped: registry grouped-expert modules switched to their built-in activation recompute.
    """

    kind: str
    layers: int = 0
    pairs: list[_Discarding] = field(default_factory=list)
    grouped: list[nn.Module] = field(default_factory=list)

    @property
    def discarded(self) -> int:
        """Outputs freed so far by the pairs."""
        return sum(pair.discarded for pair in self.pairs)

    def remove(self) -> None:
        """Undo the installation (the model computes as before)."""
        for pair in self.pairs:
            pair.remove()
        for module in self.grouped:
            module.activation_recompute = False
        self.pairs, self.grouped = [], []


def _has_builtin_activation_recompute(module: nn.Module) -> bool:
    # Grouped experts (the registry's RegistryGroupedMLP, megatron's TEGroupedMLP) recompute
    # their activation themselves when this flag is on (megatron's "moe_act").
    from megatron.core.transformer.mlp import MLP

    return not isinstance(module, MLP) and isinstance(getattr(module, "activation_recompute", None), bool)


def _has_forward(module: Any) -> bool:
    return isinstance(module, nn.Module) and "forward" not in module.__dict__


def recompute_activation(chunks: Iterable[nn.Module], num_layers: int | None = None) -> RecomputePairs:
    """Discard and recompute the MLP activation's output in the chosen layers of ``chunks``.

    Args:
        chunks: this rank's model chunks (DDP / ``Float16Module`` wrappers are fine).
        num_layers: the first ``num_layers`` layers of this pipeline stage (``None``: all).

    Returns:
        What was installed.

    Raises:
        ValueError: a chosen layer has an MLP whose activation is not a module (megatron then
            computes it inline, with no seam): build the layers with the registry spec
            (``mindspeed.megatron.spec.get_gpt_layer_spec``, ``use_te_activation_func=True``).
    """
    from megatron.core.transformer.mlp import MLP

    chunks = list(chunks)
    result = RecomputePairs(ACTIVATION)
    for layer in select_layers(chunks, num_layers):
        result.layers += 1
        for module in layer.mlp.modules():
            if _has_builtin_activation_recompute(module):
                if not module.activation_recompute:
                    module.activation_recompute = True
                    result.grouped.append(module)
            elif isinstance(module, MLP):
                activation = getattr(module, "activation_func", None)
                if not (module.config.use_te_activation_func and _has_forward(activation)):
                    result.remove()
                    raise ValueError(
                        f"recompute_activation_function: layer {layer.layer_number}'s MLP computes its activation "
                        "inline (no module to recompute); build the layers with the registry spec "
                        "(mindspeed.megatron.spec.get_gpt_layer_spec) and TransformerConfig(use_te_activation_func=True)"
                    )
                result.pairs.append(_Discarding(activation, module.linear_fc2))
    logger.info(
        "recompute_activation_function: %d layers, %d MLPs, %d grouped experts",
        result.layers,
        len(result.pairs),
        len(result.grouped),
    )
    return result


def recompute_norm(chunks: Iterable[nn.Module], num_layers: int | None = None) -> RecomputePairs:
    """Discard and recompute the outputs of ``input_layernorm`` and ``pre_mlp_layernorm``.

    Args:
        chunks: this rank's model chunks.
        num_layers: the first ``num_layers`` layers of this pipeline stage (``None``: all).

    Returns:
        What was installed (layers whose norms are megatron's ``IdentityOp`` get nothing).
    """
    from megatron.core.transformer.identity_op import IdentityOp

    result = RecomputePairs(NORM)
    for layer in select_layers(chunks, num_layers):
        result.layers += 1
        for norm, consumer in ((layer.input_layernorm, layer.self_attention), (layer.pre_mlp_layernorm, layer.mlp)):
            if not isinstance(norm, IdentityOp) and _has_forward(norm):
                result.pairs.append(_Discarding(norm, consumer))
    logger.info("recompute_norm: %d layers, %d norms", result.layers, len(result.pairs))
    return result


@dataclass
class LayerRecompute:
    """A ``post_model_build`` hook: install one kind of recompute on the built chunks.

    Attributes:
        kind: ``"activation"`` or ``"norm"``.
        num_layers: the first ``num_layers`` layers of each pipeline stage (``None``: all).
        installed: what the last :meth:`install` call installed.
    """

    kind: str
    num_layers: int | None = None
    installed: RecomputePairs | None = None

    def install(self, chunks: Iterable[nn.Module]) -> RecomputePairs:
        """Install the recompute on ``chunks`` (the trainer calls it once the model is built)."""
        if self.kind not in KINDS:
            raise ValueError(f"LayerRecompute.kind={self.kind!r} is not one of {KINDS}")
        install = recompute_activation if self.kind == ACTIVATION else recompute_norm
        self.installed = install(chunks, self.num_layers)
        return self.installed
