"""Packed (THD) microbatches for compiled ``TransformerLayer``\\ s: the packing as tensors of the token count.

A compiled layer (``train.compile``, ``fullgraph=True``) cannot trace megatron's THD paths:
its THD rope splits the tokens per ``cu_seqlens`` segment on the host (``.tolist()``, ``.item()``),
the registry attention checks the boundaries on the host and caches its mask by tensor identity,
and a shared-prefix microbatch loops over its groups' host lengths. Each would break the graph,
and ``cu_seqlens`` (one entry per sample) or the groups would recompile it whenever a microbatch
packs a different number of samples.

:func:`compiled_layer_inputs` runs eagerly before every compiled layer and rewrites its inputs
(one rewrite per microbatch, shared by the layers and the recomputation) so that everything the
graph reads is a tensor sized by the token count ``T`` only:

- the rope table is gathered at each token's position in its own sequence (``[T, 1, 1, dim]``:
  positions restart at each ``cu_seqlens`` segment, or follow the shared-prefix layout's
  ``token_positions``), which megatron's THD rope defines as its "exact mapping" case and which
  :func:`mindspeed.megatron.spec` applies as a per-token table;
- the packing becomes :class:`CompiledPackedParams`: no ``cu_seqlens``, and a ``[T, T]`` bool
  ``visible`` mask (same segment and causal; for shared-prefix groups: the prompt, and the
  token's own response) that the registry attention hands to SDPA in the graph.

The attention is then a dense masked SDPA over the microbatch (``T x T`` scores where the eager
kernels compute one block per segment): the same numbers (each row's softmax sees the same keys),
more score FLOPs, which is small beside the layers' GEMMs for the short packed sequences of
SFT/DPO/RM/RL microbatches. Sliding windows, ALiBi, attention sinks and context parallelism are
not covered and raise (``RegistryAttention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from mindspeed.megatron.shared_prefix import SharedPrefixParams


@dataclass
class CompiledPackedParams(PackedSeqParams):
    """THD params of a microbatch inside compiled layers (:func:`compiled_layer_inputs`).

    Attributes:
        visible: ``[T, T]`` bool, True where query ``i`` attends key ``j`` (causality included).
    """

    visible: torch.Tensor | None = None


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
    out = dict(kwargs, packed_seq_params=new_params)
    if table is not None:
        out["rotary_pos_emb"] = new_table
    if dynamic_tokens:
        torch._dynamo.mark_dynamic(out["hidden_states"], 0)
        torch._dynamo.mark_dynamic(new_params.visible, 0)
        torch._dynamo.mark_dynamic(new_params.visible, 1)
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
    device = cu.device
    index = torch.arange(tokens, device=device)
    segment = torch.bucketize(index, cu[1:], right=True)  # each token's segment
    causal = index[None, :] <= index[:, None]
    if isinstance(params, SharedPrefixParams):
        positions = params.token_positions.to(device)
        # Sub-sequence id: -1 for a group's prompt, else the token's response (numbered over the microbatch).
        part, count = [], 0
        for prompt, responses in params.groups:
            part.append(torch.full((prompt,), -1, dtype=torch.long))
            for n in responses:
                part.append(torch.full((n,), count, dtype=torch.long))
                count += 1
        part_id = torch.cat(part).to(device)
        own = (part_id[None, :] == -1) | (part_id[None, :] == part_id[:, None])
        visible = causal & (segment[None, :] == segment[:, None]) & own
    else:
        positions = index - cu[segment]
        visible = causal & (segment[None, :] == segment[:, None])
    new_params = CompiledPackedParams(qkv_format="thd", visible=visible)
    if table is None or table.size(0) == tokens and isinstance(params, SharedPrefixParams):
        return new_params, table  # no rope, or already per token (shared prefix: gathered by the model)
    return new_params, table[positions]


def attend_compiled_packed(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: CompiledPackedParams, scale: float | None
) -> torch.Tensor:
    """Attention of a rewritten packed microbatch: ``[T, heads, dim]`` in, ``[T, heads, dim]`` out (SDPA, masked)."""
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, T, dim]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=params.visible, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1)
