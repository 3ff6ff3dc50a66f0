"""``train.compile`` for megatron-core models: each ``TransformerLayer``'s forward compiled once (regional).

torchtitan's regional compilation on megatron-core: :func:`compile_layers` replaces the
``forward`` of every ``TransformerLayer`` of the model chunks with its ``torch.compile``
(:func:`mindspeed.compile.compile_forwards`: ``fullgraph=True``, static shapes). The layers of a
chunk run the same code on the same shapes, so dynamo compiles one graph for all of them (a
guard on the layer number's Python int aside, which does not change the graph); megatron's
``TransformerBlock`` (recompute, the final norm), the embedding, the output layer, the loss and
DDP's hooks stay eager around them, and the parameter names (checkpoints, exports) do not change.
An MoE layer compiles its attention half (``_forward_attention``: norm, attention, residual); its
router, token dispatch and experts stay eager (host-sized buffers).

Model parallelism: megatron's column-parallel linears get traceable blocking collectives
(:mod:`mindspeed.megatron.compiled_linear`), and context-parallel attention runs as one opaque op
around the eager algorithm (:mod:`mindspeed.megatron.compiled_attention`); pipeline stages compile
their own layers, megatron's schedule stays eager.
The registry kernels the layer spec plugs in (``mindspeed.ops``: their reference
implementations on the CPU) are traced into the graph with the layer. Inductor fuses the
element-wise work (RMSNorm, rotary, SwiGLU, the residual adds and their backward) that eager
runs op by op.

The trainer and the RL actor build through :func:`mindspeed_llm.training.build.build_engine`,
which calls this with ``BuildSpec.compile``, so every stage (pretrain, sft, dpo, rm) gets it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from mindspeed.compile import compile_forwards
from mindspeed.log import get_logger

logger = get_logger(__name__)


def compile_layers(chunks: list[Any], mode: str, dynamic_tokens: bool = False) -> list[str]:
    """Compile the forward of every megatron ``TransformerLayer`` in ``chunks`` (``mode``: a ``mindspeed.compile.MODES`` key).

    Packed (THD) microbatches reach the graph as tensors of the token count
    (:func:`mindspeed.megatron.compiled_packing.compiled_layer_inputs`, run eagerly before each
    layer); ``dynamic_tokens`` marks that count dynamic, for microbatches of varying length (the
    RL actor's): one graph for every length instead of one per length.

    Returns:
        the compiled layers' module names (``<chunk>.<path>``).

    Raises:
        ValueError: the chunks hold no ``TransformerLayer``.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [
        (f"{index}.{name}", module)
        for index, chunk in enumerate(chunks)
        for name, module in chunk.named_modules()
        if isinstance(module, TransformerLayer)
    ]
    if not layers:
        raise ValueError(f"train.compile={mode}: the model has no megatron TransformerLayer; set train.compile=false")
    # imported here: it imports megatron.core, whose import-time warnings belong after the run's logging is set up
    from mindspeed.megatron.compiled_attention import use_traceable_checkpoint
    from mindspeed.megatron.compiled_linear import use_traceable_linears
    from mindspeed.megatron.compiled_packing import compiled_layer_inputs

    for _, layer in layers:
        use_traceable_linears(layer)  # tensor parallelism: megatron's async collectives swapped for traceable ones
        use_traceable_checkpoint(layer)  # selective recompute of core_attn: torch.utils.checkpoint in the graph
    prepare = partial(compiled_layer_inputs, dynamic_tokens=dynamic_tokens)
    # MoE layers: the attention half (norm, attention, residual) compiled; the MLP half (router, token
    # dispatch, experts) stays eager: the dispatcher sizes its buffers from per-expert counts read on
    # the host, which dynamo cannot trace without a graph break (a data-dependent size).
    moe = [(name, layer) for name, layer in layers if _is_moe(layer)]
    dense = [(name, layer) for name, layer in layers if not _is_moe(layer)]
    names = compile_forwards(dense, mode, prepare)
    names += compile_forwards(moe, mode, prepare, method="_forward_attention")
    logger.info(
        "compile (%s): %d TransformerLayer forwards (fullgraph, static shapes)%s",
        mode,
        len(names),
        f", of them {len(moe)} MoE layers' attention only" if moe else "",
    )
    return names


def _is_moe(layer: Any) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return isinstance(layer.mlp, MoELayer)
