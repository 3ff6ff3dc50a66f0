"""Every parameter of a megatron-core ``GPTModel`` (local spec), with its shape and how TP cuts it.

This is the megatron side of every conversion, written once for all families: the names are
those of the unsharded model (tensor-, pipeline- and expert-parallel sizes 1, global layer and
expert indices), as ``GPTModel(...).state_dict()`` lists them. A bridge must produce exactly
this set from a Hugging Face checkpoint (the engine checks it), and :mod:`.layout` cuts each
entry into the pieces the ranks of a parallel layout hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from mindspeed_llm.bridges.shape import ModelShape

#: The embedding norm's module name under megatron's ``embedding`` (``mindspeed.megatron.variants``'s;
#: not imported from there, which would import megatron-core).
EMBEDDING_NORM = "word_embeddings_layernorm"


class Split(str, Enum):  # noqa: UP042  (StrEnum would change str(): kept as is)
    """How a tensor-parallel layout cuts a parameter (megatron's layer types)."""

    #: Every rank holds the whole tensor (norms, routers, row-parallel biases).
    REPLICATED = "replicated"
    #: ColumnParallelLinear: rows (output features) are cut in TP equal blocks.
    COLUMN = "column"
    #: RowParallelLinear: columns (input features) are cut in TP equal blocks.
    ROW = "row"
    #: linear_fc1 of a gated MLP: ``[gate; up]`` with rank r holding ``[gate_r; up_r]``
    #: (megatron's partition_stride 2), not a contiguous block of the fused tensor.
    GLU = "glu"
    #: Rows made of sections (``MegatronParam.sections``: the Gated DeltaNet's ``in_proj``
    #: ``[q | k | v | z | b | a]``, its ``conv1d`` ``[q | k | v]``) each cut in TP blocks, rank r
    #: holding its block of every section in order (GLU is the case of two equal sections).
    SECTIONS = "sections"
    #: VocabParallelEmbedding and the output layer: rows cut in TP blocks after padding the
    #: vocabulary to a multiple of TP.
    VOCAB = "vocab"


@dataclass(frozen=True)
class MegatronParam:
    """One parameter of the unsharded megatron model.

    Attributes:
        name: the name in the unsharded model's state dict.
        shape: its shape.
        split: how tensor parallelism cuts it.
        layer: the global decoder layer index (``None`` outside the decoder layers, e.g. in the
            multi-token-prediction layers).
        expert: the global expert index (``None`` for non-expert parameters).
        sections: row counts of the sections of a ``Split.SECTIONS`` parameter.
    """

    name: str
    shape: tuple[int, ...]
    split: Split
    layer: int | None = None
    expert: int | None = None
    sections: tuple[int, ...] | None = None

    @property
    def module(self) -> str:
        """The owning module's name (the parameter name without ``.weight`` / ``.bias``)."""
        return self.name.rsplit(".", 1)[0]


#: Module suffixes whose megatron linear layers save an ``_extra_state`` entry (None) in
#: ``state_dict``; a strict ``load_state_dict`` expects it back.
LINEAR_MODULES = (
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
    "output_layer",
    "eh_proj",
    "in_proj",
    "out_proj",
)


def _attention(shape: ModelShape, prefix: str, layer: int | None) -> list[MegatronParam]:
    h, heads = shape.hidden_size, shape.num_attention_heads
    out: list[MegatronParam] = []

    def add(name: str, dims: tuple[int, ...], split: Split) -> None:
        out.append(MegatronParam(f"{prefix}{name}", dims, split, layer))

    if shape.multi_latent_attention:
        q_width = shape.qk_head_dim + shape.qk_pos_emb_head_dim
        if shape.q_lora_rank is None:
            add("linear_q_proj.weight", (heads * q_width, h), Split.COLUMN)
        else:
            add("linear_q_down_proj.weight", (shape.q_lora_rank, h), Split.COLUMN)
            add("q_layernorm.weight", (shape.q_lora_rank,), Split.REPLICATED)
            add("linear_q_up_proj.weight", (heads * q_width, shape.q_lora_rank), Split.COLUMN)
        add("linear_kv_down_proj.weight", (shape.kv_lora_rank + shape.qk_pos_emb_head_dim, h), Split.COLUMN)
        add("kv_layernorm.weight", (shape.kv_lora_rank,), Split.REPLICATED)
        add(
            "linear_kv_up_proj.weight",
            (heads * (shape.qk_head_dim + shape.v_head_dim), shape.kv_lora_rank),
            Split.COLUMN,
        )
        add("linear_proj.weight", (h, heads * shape.v_head_dim), Split.ROW)
        return out
    d, groups = shape.kv_channels, shape.num_query_groups
    # With an output gate each group's query heads are followed by as many gate heads.
    qkv_rows = ((2 if shape.attention_output_gate else 1) * heads + 2 * groups) * d
    add("linear_qkv.weight", (qkv_rows, h), Split.COLUMN)
    if shape.add_qkv_bias or shape.add_bias_linear:
        add("linear_qkv.bias", (qkv_rows,), Split.COLUMN)
    if shape.softmax_sinks:  # one sink logit per head, cut with the heads
        add("core_attention.softmax_offset", (heads,), Split.COLUMN)
    if shape.qk_layernorm:
        add("q_layernorm.weight", (d,), Split.REPLICATED)
        add("k_layernorm.weight", (d,), Split.REPLICATED)
    add("linear_proj.weight", (h, heads * d), Split.ROW)
    if shape.add_bias_linear:  # a row-parallel bias is added after the reduction: whole on every rank
        add("linear_proj.bias", (h,), Split.REPLICATED)
    return out


def _gated_delta_net(shape: ModelShape, prefix: str, layer: int | None) -> list[MegatronParam]:
    """megatron's ``GatedDeltaNet`` (:mod:`mindspeed.megatron.gated_delta_net`): the input projection
    ``[q | k | v | z | b | a]``, the depthwise convolution over ``[q | k | v]``, per-value-head
    decay parameters, the gated output norm (one value head wide) and the output projection."""
    h = shape.hidden_size
    qk = shape.linear_num_key_heads * shape.linear_key_head_dim
    v, heads = shape.linear_num_value_heads * shape.linear_value_head_dim, shape.linear_num_value_heads
    in_sections = (qk, qk, v, v, heads, heads)
    return [
        MegatronParam(prefix + "in_proj.weight", (sum(in_sections), h), Split.SECTIONS, layer, None, in_sections),
        MegatronParam(
            prefix + "conv1d.weight",
            (2 * qk + v, 1, shape.linear_conv_kernel_dim),
            Split.SECTIONS,
            layer,
            None,
            (qk, qk, v),
        ),
        MegatronParam(prefix + "dt_bias", (heads,), Split.COLUMN, layer),
        MegatronParam(prefix + "A_log", (heads,), Split.COLUMN, layer),
        MegatronParam(prefix + "out_norm.weight", (shape.linear_value_head_dim,), Split.REPLICATED, layer),
        MegatronParam(prefix + "out_proj.weight", (h, v), Split.ROW, layer),
    ]


def _mlp(
    prefix: str,
    hidden: int,
    ffn: int,
    layer: int | None,
    expert: int | None = None,
    gated: bool = True,
    bias: bool = False,
) -> list[MegatronParam]:
    fc1_rows, fc1_split = (2 * ffn, Split.GLU) if gated else (ffn, Split.COLUMN)
    fc2_split = Split.ROW
    if bias and expert is not None:
        # megatron's experts take biases only without expert tensor parallelism (ETP 1, which the
        # core's transformer_config sets): such experts are whole on every tensor-parallel rank.
        fc1_split = fc2_split = Split.REPLICATED
    params = [MegatronParam(f"{prefix}linear_fc1.weight", (fc1_rows, hidden), fc1_split, layer, expert)]
    if bias:
        params.append(MegatronParam(f"{prefix}linear_fc1.bias", (fc1_rows,), fc1_split, layer, expert))
    params.append(MegatronParam(f"{prefix}linear_fc2.weight", (hidden, ffn), fc2_split, layer, expert))
    if bias:
        params.append(MegatronParam(f"{prefix}linear_fc2.bias", (hidden,), Split.REPLICATED, layer, expert))
    return params


def _norm(shape: ModelShape, name: str, layer: int | None) -> list[MegatronParam]:
    """A norm's weight, and its bias for LayerNorm."""
    h = shape.hidden_size
    params = [MegatronParam(name + ".weight", (h,), Split.REPLICATED, layer)]
    if shape.normalization == "LayerNorm":
        params.append(MegatronParam(name + ".bias", (h,), Split.REPLICATED, layer))
    return params


def _layer(shape: ModelShape, prefix: str, layer: int | None, moe: bool) -> list[MegatronParam]:
    # One transformer layer: a decoder layer (``layer`` its index) or the transformer layer of a
    # multi-token-prediction layer (``layer`` None: it sits with the output layer, see .layout).
    h = shape.hidden_size
    params = _norm(shape, prefix + "input_layernorm", layer)
    if layer is not None and shape.is_linear_layer(layer):
        params += _gated_delta_net(shape, prefix + "self_attention.", layer)
    else:
        params += _attention(shape, prefix + "self_attention.", layer)
    if shape.post_norm:  # mindspeed.megatron.variants: the attention output's norm
        params.append(
            MegatronParam(prefix + "self_attention.linear_proj.post_layernorm.weight", (h,), Split.REPLICATED, layer)
        )
    params += _norm(shape, prefix + "pre_mlp_layernorm", layer)
    if not moe:
        gated = shape.swiglu or shape.geglu or shape.quick_geglu
        params += _mlp(prefix + "mlp.", h, shape.ffn_hidden_size, layer, gated=gated, bias=shape.add_bias_linear)
        if shape.post_norm:  # and the MLP output's
            params.append(MegatronParam(prefix + "mlp.linear_fc2.post_layernorm.weight", (h,), Split.REPLICATED, layer))
        return params
    experts = shape.num_experts
    params.append(MegatronParam(prefix + "mlp.router.weight", (experts, h), Split.REPLICATED, layer))
    if shape.add_bias_linear:
        params.append(MegatronParam(prefix + "mlp.router.bias", (experts,), Split.REPLICATED, layer))
    if shape.moe_router_enable_expert_bias:
        params.append(MegatronParam(prefix + "mlp.router.expert_bias", (experts,), Split.REPLICATED, layer))
    for expert in range(experts):
        params += _mlp(
            f"{prefix}mlp.experts.local_experts.{expert}.",
            h,
            shape.moe_ffn_hidden_size,
            layer,
            expert,
            bias=shape.add_bias_linear,
        )
    if shape.moe_shared_expert_intermediate_size:
        params += _mlp(
            prefix + "mlp.shared_experts.",
            h,
            shape.moe_shared_expert_intermediate_size,
            layer,
            bias=shape.add_bias_linear,
        )
        if shape.moe_shared_expert_gate:  # sigmoid(x @ gate_weight.T) scales the shared experts' output
            params.append(MegatronParam(prefix + "mlp.shared_experts.gate_weight", (1, h), Split.REPLICATED, layer))
    return params


def mtp_params(shape: ModelShape) -> list[MegatronParam]:
    """The parameters of megatron's ``MultiTokenPredictionBlock`` (``mtp.layers.N.``): per layer
    the two input norms, the ``[embedding; hidden]`` projection, a transformer layer and a final
    norm (the embedding and the output layer are the main model's)."""
    h = shape.hidden_size
    params: list[MegatronParam] = []
    for index in range(shape.mtp_num_layers or 0):
        prefix = f"mtp.layers.{index}."
        params += [
            MegatronParam(prefix + "enorm.weight", (h,), Split.REPLICATED),
            MegatronParam(prefix + "hnorm.weight", (h,), Split.REPLICATED),
            MegatronParam(prefix + "eh_proj.weight", (h, 2 * h), Split.COLUMN),
        ]
        params += _layer(shape, prefix + "transformer_layer.", None, shape.mtp_is_moe)
        params.append(MegatronParam(prefix + "final_layernorm.weight", (h,), Split.REPLICATED))
    return params


def megatron_params(shape: ModelShape) -> dict[str, MegatronParam]:
    """All parameters (and persistent buffers) of the unsharded megatron GPT model.

    Args:
        shape: the model.

    Returns:
        name -> :class:`MegatronParam`, in the model's state-dict order.
    """
    h = shape.hidden_size
    params = [MegatronParam("embedding.word_embeddings.weight", (shape.vocab_size, h), Split.VOCAB)]
    if shape.embedding_layernorm:  # mindspeed.megatron.variants: the embedding output's norm
        params += _norm(shape, f"embedding.{EMBEDDING_NORM}", None)
    for layer in range(shape.num_layers):
        params += _layer(shape, f"decoder.layers.{layer}.", layer, shape.is_moe_layer(layer))
    params += _norm(shape, "decoder.final_layernorm", None)
    params += mtp_params(shape)
    if shape.num_labels:  # a score head (a reward model or a critic): replicated over tensor-parallel ranks
        params.append(MegatronParam("output_layer.weight", (shape.num_labels, h), Split.REPLICATED))
    elif shape.untie_embeddings_and_output_weights:
        params.append(MegatronParam("output_layer.weight", (shape.vocab_size, h), Split.VOCAB))
    return {p.name: p for p in params}


def has_extra_state(module: str) -> bool:
    """Whether megatron's module ``module`` (a dotted name) saves an ``_extra_state`` entry."""
    return module.rsplit(".", 1)[-1] in LINEAR_MODULES
