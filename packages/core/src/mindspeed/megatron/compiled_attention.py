"""Context-parallel attention inside a compiled ``TransformerLayer``: one opaque op around the eager algorithm.

Under ``parallel.cp`` the attention of a layer is a communication algorithm
(:mod:`mindspeed.parallel.context_parallel`: the ring's ``batch_isend_irecv`` overlapped with
the block kernels, Ulysses' all-to-alls, the KV all-gather, hybrid, adaptive), written as eager
``autograd.Function``\\ s with host-side plans. Dynamo cannot trace point-to-point sends
(``isend`` / ``irecv`` are not among the collectives it rewrites into functional ones) and
would break the graph on the plans, so the compiled layer calls :func:`eager_attention`
instead: one custom op, opaque to dynamo and Inductor (a fake kernel gives its shape), whose
kernel runs the eager algorithm as it runs without compile. Everything around it (the QKV
and output projections, rotary, the norms, the MLP) stays in the graph.

The backward op recomputes the algorithm's forward with autograd on (a compiled backward runs
an op's kernel below autograd: the kernel takes the autograd keys off the thread's exclude set
and turns grad mode on) and takes its gradients with ``torch.autograd.grad``: one extra attention forward (with its
communication) per layer in the backward, the price of keeping the algorithm's own backward.

The op's ``call`` argument picks the eager attention from :data:`_CALLS`: layers whose
attention is configured alike (the same algorithm, groups, kernel, scale, window) share one
entry, so they share one graph too (a per-layer constant would specialise a graph per layer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

#: The eager attentions the op runs, ``(query, key, value) -> out`` in megatron's ``[s, b, n, d]``
#: layout (out ``[s, b, n * d]``); the op's ``call`` is an index here.
_CALLS: list[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = []
_KEYS: dict[tuple, int] = {}


def register_call(key: tuple, call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """The index of the eager attention for ``key`` (hashable: everything the attention depends on).

    The ``call`` registered last for a key serves every layer with that key (they compute the same): a
    model built later replaces a destroyed one's, whose process groups' ids its own may reuse.
    """
    if key not in _KEYS:
        _KEYS[key] = len(_CALLS)
        _CALLS.append(call)
    _CALLS[_KEYS[key]] = call
    return _KEYS[key]


def config_key(*parts: Any) -> tuple:
    """A hashable key of the values an attention depends on: scalars as they are, anything else (process
    groups, kernels) by identity; objects' attributes one level deep, private caches (``_name``) left out."""

    def one(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return tuple(one(v) for v in value)
        return ("id", id(value))

    key = []
    for part in parts:
        if hasattr(part, "__dict__") and not callable(part):
            key.append(
                (
                    type(part).__name__,
                    tuple((k, one(v)) for k, v in sorted(vars(part).items()) if not k.startswith("_")),
                )
            )
        else:
            key.append(one(part))
    return tuple(key)


@torch.library.custom_op("mindspeed::eager_attention", mutates_args=())
def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: int) -> torch.Tensor:
    """The eager attention ``_CALLS[call]`` of ``[s, b, n, d]`` query, key and value: ``[s, b, n * d_v]`` (opaque)."""
    return _CALLS[call](query, key, value).contiguous()


@eager_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: int) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[1], query.shape[2] * value.shape[3])


@torch.library.custom_op("mindspeed::eager_attention_backward", mutates_args=())
def eager_attention_backward(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`eager_attention` (its forward recomputed with autograd on)."""
    with _autograd_on():
        inputs = [t.detach().requires_grad_() for t in (query, key, value)]
        out = _CALLS[call](*inputs)
        grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(grads, inputs))


def _autograd_on() -> Any:
    """Autograd recording inside an op's kernel: grad mode on, and the autograd dispatch keys taken off the
    thread's exclude set (a compiled backward runs its ops' kernels below autograd)."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    return _Both(
        torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad()
    )


class _Both:
    """Two context managers as one, entered in order."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


@eager_attention_backward.register_fake
def _(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: int):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    query, key, value, call = inputs
    ctx.save_for_backward(query, key, value)
    ctx.call = call


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    query, key, value = ctx.saved_tensors
    dq, dk, dv = eager_attention_backward(grad.contiguous(), query, key, value, ctx.call)
    return dq, dk, dv, None


eager_attention.register_autograd(_backward, setup_context=_setup)


def use_traceable_checkpoint(module: torch.nn.Module) -> int:
    """Selective recompute (``core_attn``) of every megatron ``Attention`` under ``module`` through
    ``torch.utils.checkpoint`` (non-reentrant), which dynamo traces as a checkpointed region of the
    graph; megatron's ``tensor_parallel.checkpoint`` saves and restores the RNG states with
    ``get_rng_state``, which dynamo refuses to trace. The recomputed core attention draws no random
    numbers (the registry attention has no dropout), so nothing of the RNG bookkeeping is lost.

    Returns:
        how many attentions it changed.
    """
    count = 0
    for attention in module.modules():
        if getattr(attention, "checkpoint_core_attention", False) and hasattr(attention, "core_attention"):
            attention._checkpointed_attention_forward = functools.partial(_checkpointed_core_attention, attention)
            count += 1
    return count


def _checkpointed_core_attention(
    attention: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    rotary_pos_emb: Any = None,
    attn_mask_type: Any = None,
    attention_bias: torch.Tensor | None = None,
    packed_seq_params: Any = None,
) -> torch.Tensor:
    """megatron's ``Attention._checkpointed_attention_forward`` with ``torch.utils.checkpoint``."""
    mask_type = attention.attn_mask_type if attn_mask_type is None else attn_mask_type

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention.core_attention(
            q,
            k,
            v,
            attention_mask,
            attn_mask_type=mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )

    return torch.utils.checkpoint.checkpoint(run, query, key, value, use_reentrant=False)
