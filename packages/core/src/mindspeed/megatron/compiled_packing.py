"""Packed (THD) microbatches for compiled ``TransformerLayer``\\ s: nothing in the graph sized by the packing.

A compiled layer (``train.compile``, ``fullgraph=True``) cannot trace megatron's THD paths:
its THD rope splits the tokens per ``cu_seqlens`` segment on the host (``.tolist()``, ``.item()``),
the registry attention checks the boundaries on the host and caches its mask by tensor identity,
and a shared-prefix microbatch loops over its groups' host lengths. Each would break the graph,
and ``cu_seqlens`` (one entry per sample) or the groups would recompile it whenever a microbatch
packs a different number of samples.

:func:`compiled_layer_inputs` runs eagerly before every compiled layer (one rewrite per
microbatch, shared by the layers and megatron's recompute) so that the graph reads only tensors
sized by the token count ``T``:

- the rope table is gathered at each token's position in its own sequence (``[T, 1, 1, dim]``:
  positions restart at each ``cu_seqlens`` segment, or follow the shared-prefix layout's
  ``token_positions``), which megatron's THD rope defines as its "exact mapping" case and which
  :mod:`mindspeed.megatron.spec` applies as a per-token table;
- the packing becomes :class:`CompiledPackedParams` (no boundaries), and ``RegistryAttention``
  calls :func:`packed_attention`: one custom op, opaque to dynamo and Inductor (a fake kernel gives
  its shape), whose kernel runs the eager per-segment attention (the registry kernel with
  ``cu_seqlens``, or :func:`~mindspeed.megatron.shared_prefix.attend_shared_prefix`) on the
  microbatch's packing, recorded here when the first layer ran. Where gradients are wanted the
  layer calls :func:`packed_attention_saved` instead: its kernel runs the same attention under
  ``torch.func.vjp`` and keeps the pullback (what the eager kernel's autograd saves: the inputs,
  the outputs and, for SDPA's fused kernels, the log-sum-exp) under a handle the graph carries to
  the backward op, which runs the eager backward kernels on it: no attention forward is recomputed
  in the backward, and the gradients are those of the eager path. Pullbacks left over when the
  next microbatch starts (a forward without backward) are dropped; a backward whose pullback was
  dropped recomputes the forward.

A dense ``[T, T]`` mask in the graph would do as well for the numbers but costs ~4x the segmented
attention at the RL actor's sizes (docs/rl/benchmark.md). Sliding windows, ALiBi, attention sinks
and context parallelism are not covered and raise (``RegistryAttention``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from mindspeed.megatron.shared_prefix import SharedPrefixParams, attend_shared_prefix
from mindspeed.ops import resolve_kernel


@dataclass
class CompiledPackedParams(PackedSeqParams):
    """THD params of a microbatch inside compiled layers (:func:`compiled_layer_inputs`): no boundaries
    for the graph to read; the attention op reads the eager packing at run time."""


#: The last microbatch's rewrite: (its params, its rope table, the rewritten params, the gathered table).
_last: list[Any] = [None, None, None, None]


def compiled_layer_inputs(kwargs: dict[str, Any], dynamic_tokens: bool = False) -> dict[str, Any]:
    """The keyword arguments of a compiled ``TransformerLayer`` call, THD packing rewritten (module doc).

    Args:
        kwargs: the layer's keyword arguments, as megatron's ``TransformerBlock`` passes them.
        dynamic_tokens: mark the token dimension dynamic (microbatches of varying length compile one
            graph, not one per length).

    Returns:
        ``kwargs`` unchanged without packing, else a copy with the packing and the rope table rewritten.
    """
    hidden = kwargs.get("hidden_states")
    if torch.is_tensor(hidden) and hidden.is_contiguous():
        # One stride for the size-1 batch dimension of a THD microbatch (the embedding's output and a
        # layer's differ there), or dynamo's stride guard compiles the first layer a graph of its own.
        kwargs = dict(kwargs, hidden_states=hidden.view(-1).view(hidden.shape))
    params = kwargs.get("packed_seq_params")
    if params is None or params.qkv_format != "thd" or isinstance(params, CompiledPackedParams):
        if dynamic_tokens and torch.is_tensor(kwargs.get("hidden_states")):
            torch._dynamo.mark_dynamic(kwargs["hidden_states"], 0)
        return kwargs
    table = kwargs.get("rotary_pos_emb")
    if _last[0] is params and _last[1] is table:
        new_params, new_table = _last[2], _last[3]
    else:
        new_params, new_table = _rewrite(params, table)
        _last[:] = [params, table, new_params, new_table]
    if _current[0] is not params:
        _saved.clear()  # a new microbatch: the last one's backward has run (pp = 1), or never will
    _current[0] = params
    out = dict(kwargs, packed_seq_params=new_params)
    if table is not None:
        out["rotary_pos_emb"] = new_table
    if dynamic_tokens:
        torch._dynamo.mark_dynamic(out["hidden_states"], 0)
        if table is not None:
            torch._dynamo.mark_dynamic(new_table, 0)
    return out


def _rewrite(params: PackedSeqParams, table: torch.Tensor | None) -> tuple[CompiledPackedParams, Any]:
    if params.cu_seqlens_q_padded is not None or (
        params.cu_seqlens_kv is not None and not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv)
    ):
        raise ValueError(
            "compiled layers take packed microbatches with cu_seqlens_q == cu_seqlens_kv and no padded "
            "boundaries; set train.compile=false"
        )
    cu = params.cu_seqlens_q.long()
    tokens = int(cu[-1])
    new_params = CompiledPackedParams(qkv_format="thd")
    if table is None or table.size(0) == tokens and isinstance(params, SharedPrefixParams):
        return new_params, table  # no rope, or already per token (shared prefix: gathered by the model)
    index = torch.arange(tokens, device=cu.device)
    positions = index - cu[torch.bucketize(index, cu[1:], right=True)]  # restart at each segment
    return new_params, table[positions]


#: The eager packing of the microbatch the compiled layers run now (set by :func:`compiled_layer_inputs`),
#: read by the opaque per-segment attention op at run time (megatron runs a microbatch's backward
#: before the next microbatch's forward at pp = 1, the only layout the actor compiles).
_current: list[Any] = [None]


@functools.cache
def _attention_kernel(impl: str) -> Any:
    return resolve_kernel("attention", impl)


def _attend_segments(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, impl: str
) -> torch.Tensor:
    """The eager packed attention (per ``cu_seqlens`` segment, or per shared-prefix group) of the current microbatch."""
    params, kernel = _current[0], _attention_kernel(impl)
    if params is None or int(params.cu_seqlens_q[-1]) != query.shape[0]:
        raise RuntimeError("the packed attention op ran without its microbatch's packing (compiled_layer_inputs)")
    if isinstance(params, SharedPrefixParams):
        return attend_shared_prefix(kernel, query, key, value, params, scale)
    out = kernel(query[None], key[None], value[None], causal=True, softmax_scale=scale, cu_seqlens=params.cu_seqlens_q)
    return out[0]


@torch.library.custom_op("mindspeed::packed_attention", mutates_args=())
def packed_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, impl: str
) -> torch.Tensor:
    """Causal attention of the current packed microbatch, ``[T, heads, dim]``, segment by segment (opaque to the graph)."""
    return _attend_segments(query, key, value, scale, impl).contiguous()


@packed_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, impl: str) -> torch.Tensor:
    return torch.empty(query.shape[:-1] + value.shape[-1:], dtype=query.dtype, device=query.device)


@torch.library.custom_op("mindspeed::packed_attention_backward", mutates_args=())
def packed_attention_backward(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, impl: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`packed_attention` (its forward recomputed with autograd, segment by segment)."""
    # torch.func: autograd is excluded inside an op's kernel, the functional transform brings its own.
    _, vjp = torch.func.vjp(lambda q, k, v: _attend_segments(q, k, v, scale, impl), query, key, value)
    return tuple(g.contiguous() for g in vjp(grad))


@packed_attention_backward.register_fake
def _(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, impl: str):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    query, key, value, scale, impl = inputs
    ctx.save_for_backward(query, key, value)
    ctx.scale, ctx.impl = scale, impl


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    query, key, value = ctx.saved_tensors
    dq, dk, dv = packed_attention_backward(grad.contiguous(), query, key, value, ctx.scale, ctx.impl)
    return dq, dk, dv, None, None


packed_attention.register_autograd(_backward, setup_context=_setup)


_FUNCTORCH_KEYS = tuple(
    getattr(torch._C.DispatchKey, name)
    for name in ("FuncTorchGradWrapper", "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode")
)


def _functorch_keys_included() -> Any:
    """A guard that takes torch.func's dispatch keys off the thread's excluded keys for its block."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    if not any(exclude.has(key) for key in _FUNCTORCH_KEYS):
        return contextlib.nullcontext()
    for key in _FUNCTORCH_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


#: Pullbacks of :func:`packed_attention_saved` awaiting their backward, by handle (one microbatch's layers at most).
_saved: dict[int, Any] = {}
_handles = itertools.count()


@torch.library.custom_op("mindspeed::packed_attention_saved", mutates_args=())
def packed_attention_saved(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`packed_attention` for a graph that will run its backward: also returns the handle of
    the saved pullback (a 0-d int64 tensor) that :func:`packed_attention_saved_backward` takes."""
    # torch.func: autograd is excluded inside an op's kernel, the functional transform brings its own.
    # With the transform's dispatch keys on: AOT autograd's first call runs the op under an aliasing
    # check that excludes them (the transform's wrapped tensors would not dispatch).
    with _functorch_keys_included():
        out, pullback = torch.func.vjp(lambda q, k, v: _attend_segments(q, k, v, scale, impl), query, key, value)
    handle = next(_handles)
    _saved[handle] = pullback
    return out.contiguous(), torch.tensor(handle, dtype=torch.int64)


@packed_attention_saved.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, impl: str):
    out = torch.empty(query.shape[:-1] + value.shape[-1:], dtype=query.dtype, device=query.device)
    return out, torch.empty((), dtype=torch.int64, device=query.device)


@torch.library.custom_op("mindspeed::packed_attention_saved_backward", mutates_args=())
def packed_attention_saved_backward(
    grad: torch.Tensor,
    handle: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`packed_attention_saved` from its saved pullback (``query``, ``key``,
    ``value``: recomputed from them only where the pullback was dropped)."""
    pullback = _saved.pop(int(handle), None)
    if pullback is None:
        return packed_attention_backward(grad, query, key, value, scale, impl)
    return tuple(g.contiguous() for g in pullback(grad))


@packed_attention_saved_backward.register_fake
def _(grad, handle, query, key, value, scale, impl):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_saved(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    query, key, value, scale, impl = inputs
    ctx.save_for_backward(output[1], query, key, value)
    ctx.mark_non_differentiable(output[1])
    ctx.scale, ctx.impl = scale, impl


def _backward_saved(ctx: Any, grad: torch.Tensor, _grad_handle: Any) -> tuple[Any, ...]:
    handle, query, key, value = ctx.saved_tensors
    dq, dk, dv = packed_attention_saved_backward(grad.contiguous(), handle, query, key, value, ctx.scale, ctx.impl)
    return dq, dk, dv, None, None


packed_attention_saved.register_autograd(_backward_saved, setup_context=_setup_saved)
