"""The parameter-rule vocabulary bridges are written in.

A rule maps one megatron parameter to the Hugging Face tensors it is made of. Names are
templates: ``{layer}`` stands for the layer index and ``{expert}`` for the expert index, so
one rule covers every layer (or every expert of every MoE layer). ``layers`` restricts a rule
to dense layers or MoE layers (DeepSeek's first-k dense layers, Qwen3-MoE's ``mlp_only_layers``).
Multi-token-prediction layers use ``{mtp}`` (their index, megatron's ``mtp.layers.{mtp}``) and
``{mtp_layer}`` (the decoder layer count plus that index: where DeepSeek-V3 checkpoints put them).

Each rule converts in both directions (``to_megatron`` / ``to_hf``) and computes shapes without
data (``megatron_shape`` / ``hf_shapes``), so a conversion is planned and checked before any
tensor is read. ``to_megatron_blocks`` / ``to_hf_blocks`` do the same conversion as views
(:class:`~mindspeed.checkpointing.blocks.Blocks`), for writers that stream bytes to files.

    Rename("decoder.layers.{layer}.input_layernorm.weight", "model.layers.{layer}.input_layernorm.weight")
    FuseQKV("decoder.layers.{layer}.self_attention.linear_qkv.weight",
            q="model.layers.{layer}.self_attn.q_proj.weight", k=..., v=...)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from mindspeed.checkpointing.blocks import Blocks
from mindspeed_llm.bridges.shape import ModelShape

Shape = tuple[int, ...]

#: Values of ``ParamRule.layers``: every layer, only layers with a dense MLP, only MoE layers,
#: only Gated DeltaNet (linear-attention) layers, only softmax-attention layers.
LAYER_SCOPES = ("all", "dense", "moe", "linear", "attention")


@dataclass(frozen=True)
class ParamRule:
    """Base of all rules: one megatron name template and its Hugging Face name templates.

    Attributes:
        mg: megatron name template.
        hf: Hugging Face name templates, in the order ``to_megatron`` takes them.
        layers: ``"all"``, ``"dense"`` or ``"moe"``; rules with ``{expert}`` imply ``"moe"``.
        when: a boolean :class:`ModelShape` field the rule depends on (``None``: always active;
            set by :func:`only_if`).
    """

    mg: str
    hf: tuple[str, ...]
    layers: str = "all"
    when: str | None = None

    def __post_init__(self) -> None:
        if self.layers not in LAYER_SCOPES:
            raise ValueError(f"{type(self).__name__}({self.mg!r}): layers={self.layers!r} is not one of {LAYER_SCOPES}")

    def to_megatron(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        """The megatron tensor made of the Hugging Face ``tensors`` (in ``hf`` order)."""
        raise NotImplementedError

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        """The Hugging Face tensors (in ``hf`` order) made of the megatron ``tensor``."""
        raise NotImplementedError

    def to_megatron_blocks(self, tensors: list[torch.Tensor], shape: ModelShape) -> Blocks:
        """:meth:`to_megatron` as views of ``tensors`` (default: the materialised tensor)."""
        return Blocks.of(self.to_megatron(tensors, shape))

    def to_hf_blocks(self, blocks: Blocks, shape: ModelShape) -> list[Blocks]:
        """:meth:`to_hf` on a megatron tensor given as views (default: through the materialised tensor)."""
        return [Blocks.of(tensor) for tensor in self.to_hf(blocks.tensor(), shape)]

    def megatron_shape(self, hf_shapes: list[Shape], shape: ModelShape) -> Shape:
        """The megatron shape ``to_megatron`` produces; raises ``ValueError`` if the inputs disagree."""
        raise NotImplementedError

    def hf_shapes(self, mg_shape: Shape, shape: ModelShape) -> list[Shape]:
        """The Hugging Face shapes ``to_hf`` produces."""
        raise NotImplementedError

    def optional_hf(self, shape: ModelShape) -> tuple[str, ...]:
        """Hugging Face templates this rule consumes when present and writes nowhere (default none)."""
        return ()

    def active(self, shape: ModelShape) -> bool:
        """Whether the rule produces a megatron tensor for this model (default: unless its
        ``when`` field is false)."""
        return self.when is None or bool(getattr(shape, self.when))


class Rename(ParamRule):
    """One Hugging Face tensor is the megatron tensor, under another name."""

    def __init__(self, mg: str, hf: str, layers: str = "all") -> None:
        super().__init__(mg, (hf,), layers)

    def to_megatron(self, tensors, shape):
        return tensors[0]

    def to_hf(self, tensor, shape):
        return [tensor]

    def to_megatron_blocks(self, tensors, shape):
        return Blocks.of(tensors[0])

    def to_hf_blocks(self, blocks, shape):
        return [blocks]

    def megatron_shape(self, hf_shapes, shape):
        return tuple(hf_shapes[0])

    def hf_shapes(self, mg_shape, shape):
        return [tuple(mg_shape)]


class FuseQKV(ParamRule):
    """Separate q, k, v projections (weights or biases) fused in megatron's grouped layout.

    megatron's ``linear_qkv`` output is viewed as ``[num_query_groups, (heads_per_group + 2) *
    head_dim]``: for each query group, its query heads, then its key head, then its value head.
    Tensor parallelism then gives every rank whole groups (a contiguous block of rows).
    """

    def __init__(self, mg: str, q: str, k: str, v: str, layers: str = "all") -> None:
        super().__init__(mg, (q, k, v), layers)

    @staticmethod
    def _sizes(shape: ModelShape) -> tuple[int, int, int]:
        groups, d = shape.num_query_groups, shape.kv_channels
        return groups, shape.num_attention_heads // groups * d, d

    def to_megatron(self, tensors, shape):
        q, k, v = tensors
        groups, q_rows, d = self._sizes(shape)
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(groups, q_rows, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
        )
        return fused.reshape(-1, *rest)

    def to_hf(self, tensor, shape):
        groups, q_rows, d = self._sizes(shape)
        rest = tensor.shape[1:]
        q, k, v = tensor.reshape(groups, q_rows + 2 * d, *rest).split([q_rows, d, d], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]

    def to_megatron_blocks(self, tensors, shape):
        q, k, v = tensors
        groups, q_rows, d = self._sizes(shape)
        return Blocks(
            [
                block
                for g in range(groups)
                for block in ([q[g * q_rows : (g + 1) * q_rows]], [k[g * d : (g + 1) * d]], [v[g * d : (g + 1) * d]])
            ]
        )

    def to_hf_blocks(self, blocks, shape):
        groups, q_rows, d = self._sizes(shape)
        width = q_rows + 2 * d
        return [
            Blocks.stack([blocks.rows(g * width + start, g * width + start + size) for g in range(groups)])
            for start, size in ((0, q_rows), (q_rows, d), (q_rows + d, d))
        ]

    def megatron_shape(self, hf_shapes, shape):
        groups, q_rows, d = self._sizes(shape)
        expected = [(groups * q_rows,), (groups * d,), (groups * d,)]
        for got, want, role in zip(hf_shapes, expected, "qkv"):
            if tuple(got[:1]) != want or tuple(got[1:]) != tuple(hf_shapes[0][1:]):
                raise ValueError(
                    f"{role} has shape {tuple(got)} but num_attention_heads={shape.num_attention_heads}, "
                    f"num_key_value_heads={shape.num_query_groups}, head_dim={d} give {want[0]} rows"
                )
        return (groups * (q_rows + 2 * d), *hf_shapes[0][1:])

    def hf_shapes(self, mg_shape, shape):
        groups, q_rows, d = self._sizes(shape)
        rest = tuple(mg_shape[1:])
        return [(groups * q_rows, *rest), (groups * d, *rest), (groups * d, *rest)]


class FuseGateUp(ParamRule):
    """Gate and up projections stacked as megatron's gated ``linear_fc1``: ``[gate; up]``."""

    def __init__(self, mg: str, gate: str, up: str, layers: str = "all") -> None:
        super().__init__(mg, (gate, up), layers)

    def to_megatron(self, tensors, shape):
        return torch.cat(tensors, dim=0)

    def to_hf(self, tensor, shape):
        return list(tensor.chunk(2, dim=0))

    def to_megatron_blocks(self, tensors, shape):
        return Blocks([[tensors[0]], [tensors[1]]])

    def to_hf_blocks(self, blocks, shape):
        half = blocks.shape[0] // 2
        return [blocks.rows(0, half), blocks.rows(half, 2 * half)]

    def megatron_shape(self, hf_shapes, shape):
        gate, up = (tuple(s) for s in hf_shapes)
        if gate != up:
            raise ValueError(f"gate {gate} and up {up} projections differ in shape")
        return (2 * gate[0], *gate[1:])

    def hf_shapes(self, mg_shape, shape):
        half = (mg_shape[0] // 2, *mg_shape[1:])
        return [half, half]


class Tie(Rename):
    """The output layer: a plain rename when untied; when the model ties it to the embedding,
    megatron stores nothing and a Hugging Face copy (if the checkpoint has one) is dropped.
    A model with a score head (``shape.num_labels``) has no language-model head."""

    def active(self, shape):
        return shape.untie_embeddings_and_output_weights and not shape.num_labels


class ScoreHead(Rename):
    """The score head of a ``*ForSequenceClassification`` model (``shape.num_labels`` rows) is the
    megatron output layer; absent from language models."""

    def active(self, shape):
        return bool(shape.num_labels)

    def optional_hf(self, shape):
        return () if self.active(shape) else self.hf


class Drop(ParamRule):
    """Hugging Face tensors that carry no weights (old rotary ``inv_freq`` buffers): consumed
    when present, never written."""

    def __init__(self, hf: str, layers: str = "all") -> None:
        super().__init__("", (hf,), layers)

    def active(self, shape):
        return False

    def optional_hf(self, shape):
        return self.hf


class DropExtraLayers(ParamRule):
    """Every Hugging Face tensor of a layer past the model's decoder layers (and past the
    multi-token-prediction layers being converted), dropped: the multi-token-prediction layers
    DeepSeek-V3 checkpoints append, unless asked for (transformers ignores them too).

    Args:
        prefix: the layers' name prefix (``model.layers.``).
    """

    def __init__(self, prefix: str = "model.layers.") -> None:
        super().__init__("", (prefix,), "all")

    def active(self, shape):
        return False

    def drops(self, name: str, shape: ModelShape) -> bool:
        """Whether ``name`` belongs to a layer index at or past the layers converted."""
        prefix = self.hf[0]
        if not name.startswith(prefix):
            return False
        index = name[len(prefix) :].split(".", 1)[0]
        return index.isdigit() and int(index) >= shape.num_layers + (shape.mtp_num_layers or 0)


class CopyOf(ParamRule):
    """A Hugging Face tensor that repeats another one and has no megatron tensor of its own:
    DeepSeek-V3's multi-token-prediction layers keep copies of the embedding and the output head,
    which megatron shares with the main model. Read, the copy must equal the original (checked
    by the source); written, it gets the original's bytes.

    Args:
        hf: the copy's name template.
        of: the original's name.
        of_tied: the original when the model ties its output layer to the embedding.
    """

    def __init__(self, hf: str, of: str, of_tied: str | None = None) -> None:
        super().__init__("", (hf,), "all")
        object.__setattr__(self, "of", of)
        object.__setattr__(self, "of_tied", of_tied or of)

    def active(self, shape):
        return False

    def copies(self, shape: ModelShape) -> dict[str, str]:
        """Copy name -> original name, for this model."""
        original = self.of_tied if shape.tie_embeddings else self.of
        return {name: original for name in expand_names(self, shape, self.hf[0])}


@dataclass
class Task:
    """One expanded rule: a concrete megatron name and the Hugging Face names it is made of.

    Attributes:
        rule: the rule.
        mg_name: the megatron parameter.
        hf_names: the Hugging Face tensors, in the rule's order.
        layer: global decoder layer index (``None`` outside the decoder layers).
        expert: global expert index (``None`` for non-expert tensors).
        mtp: multi-token-prediction layer index (``None`` outside those layers).
    """

    rule: ParamRule
    mg_name: str
    hf_names: list[str]
    layer: int | None = None
    expert: int | None = None
    mtp: int | None = None


def _slots(rule: ParamRule, shape: ModelShape, template: str) -> list[tuple[int | None, int | None]]:
    # (decoder layer, multi-token-prediction layer) pairs a template expands over.
    scope = "moe" if "{expert}" in template else rule.layers
    if "{mtp}" in template or "{mtp_layer}" in template:
        if (scope == "moe" and not shape.mtp_is_moe) or (scope == "dense" and shape.mtp_is_moe):
            return []
        return [(None, index) for index in range(shape.mtp_num_layers or 0)]
    if "{layer}" not in template:
        return [(None, None)]
    keep = {
        "all": lambda i: True,
        "dense": lambda i: not shape.is_moe_layer(i),
        "moe": shape.is_moe_layer,
        "linear": shape.is_linear_layer,
        "attention": lambda i: not shape.is_linear_layer(i),
    }[scope]
    return [(i, None) for i in range(shape.num_layers) if keep(i)]


def _fill(template: str, shape: ModelShape, layer: int | None, expert: int | None, mtp: int | None) -> str:
    if "{" not in template:
        return template
    return template.format(
        layer=layer, expert=expert, mtp=mtp, mtp_layer=None if mtp is None else shape.num_layers + mtp
    )


def expand_names(rule: ParamRule, shape: ModelShape, template: str) -> list[str]:
    """Every concrete name of ``template`` (a name template of ``rule``) for the model ``shape``."""
    names = []
    for layer, mtp in _slots(rule, shape, template):
        experts = range(shape.num_experts or 0) if "{expert}" in template else [None]
        names += [_fill(template, shape, layer, expert, mtp) for expert in experts]
    return names


def expand_rule(rule: ParamRule, shape: ModelShape) -> list[Task]:
    """Every concrete task of ``rule`` for the model ``shape`` (none when inactive)."""
    if not rule.active(shape):
        return []
    tasks = []
    for layer, mtp in _slots(rule, shape, rule.mg):
        experts = range(shape.num_experts) if "{expert}" in rule.mg else [None]
        for expert in experts:
            tasks.append(
                Task(
                    rule,
                    _fill(rule.mg, shape, layer, expert, mtp),
                    [_fill(t, shape, layer, expert, mtp) for t in rule.hf],
                    layer,
                    expert,
                    mtp,
                )
            )
    return tasks


def expand_optional(rule: ParamRule, shape: ModelShape) -> list[str]:
    """The concrete Hugging Face names ``rule`` consumes when present and writes nowhere."""
    return [name for template in rule.optional_hf(shape) for name in expand_names(rule, shape, template)]


def for_mtp(
    rules: tuple[ParamRule, ...], mg_layer: str, hf_layer: str, mg_mtp: str, hf_mtp: str
) -> tuple[ParamRule, ...]:
    """The decoder-layer rules among ``rules`` rewritten for the transformer layer of a
    multi-token-prediction layer (the same parameters under other prefixes).

    Args:
        rules: rules; those whose megatron name starts with ``mg_layer`` are rewritten, the rest left out.
        mg_layer: the decoder layer prefix in megatron names (``decoder.layers.{layer}.``).
        hf_layer: the decoder layer prefix in Hugging Face names (``model.layers.{layer}.``).
        mg_mtp: its replacement in megatron names (``mtp.layers.{mtp}.transformer_layer.``).
        hf_mtp: its replacement in Hugging Face names (``model.layers.{mtp_layer}.``).
    """
    out = []
    for rule in rules:
        if not rule.mg.startswith(mg_layer):
            continue
        clone = copy.copy(rule)
        object.__setattr__(clone, "mg", mg_mtp + rule.mg[len(mg_layer) :])
        object.__setattr__(clone, "hf", tuple(t.replace(hf_layer, hf_mtp, 1) for t in rule.hf))
        out.append(clone)
    return tuple(out)


def only_if(field: str, rules: tuple[ParamRule, ...]) -> tuple[ParamRule, ...]:
    """``rules`` active only for models whose boolean :class:`ModelShape` ``field`` is true
    (GLM-4.5's q/k/v biases with ``add_qkv_bias``, its QK norm with ``qk_layernorm``)."""
    out = []
    for rule in rules:
        clone = copy.copy(rule)
        object.__setattr__(clone, "when", field)
        out.append(clone)
    return tuple(out)


class Transposed(Rename):
    """One Hugging Face tensor is the megatron tensor transposed (GPT-OSS keeps expert weights
    ``[in, out]``, megatron's linear layers ``[out, in]``)."""

    def to_megatron(self, tensors, shape):
        return tensors[0].transpose(0, 1).contiguous()

    def to_hf(self, tensor, shape):
        return [tensor.transpose(0, 1).contiguous()]

    def to_megatron_blocks(self, tensors, shape):
        return Blocks.of(self.to_megatron(tensors, shape))

    def to_hf_blocks(self, blocks, shape):
        return [Blocks.of(t) for t in self.to_hf(blocks.tensor(), shape)]

    def megatron_shape(self, hf_shapes, shape):
        return tuple(reversed(hf_shapes[0]))

    def hf_shapes(self, mg_shape, shape):
        return [tuple(reversed(mg_shape))]


class InterleavedGateUp(Rename):
    """A fused gate/up projection with gate and up interleaved along the output features (GPT-OSS:
    ``gate = x[..., ::2]``, ``up = x[..., 1::2]``), as megatron's ``[gate; up]`` ``linear_fc1``.

    The Hugging Face tensor is a weight ``[in, 2 * ffn]`` (``transposed``) or a bias ``[2 * ffn]``.
    """

    def __init__(self, mg: str, hf: str, transposed: bool = False, layers: str = "all") -> None:
        super().__init__(mg, hf, layers)
        object.__setattr__(self, "transposed", transposed)

    def to_megatron(self, tensors, shape):
        fused = tensors[0].transpose(0, 1) if self.transposed else tensors[0]  # [2 * ffn, ...]
        return torch.cat([fused[0::2], fused[1::2]], dim=0).contiguous()

    def to_hf(self, tensor, shape):
        gate, up = tensor.chunk(2, dim=0)
        fused = torch.stack([gate, up], dim=1).flatten(0, 1)  # rows gate0, up0, gate1, up1 ...
        return [(fused.transpose(0, 1) if self.transposed else fused).contiguous()]

    def to_megatron_blocks(self, tensors, shape):
        return Blocks.of(self.to_megatron(tensors, shape))

    def to_hf_blocks(self, blocks, shape):
        return [Blocks.of(t) for t in self.to_hf(blocks.tensor(), shape)]

    def megatron_shape(self, hf_shapes, shape):
        return tuple(reversed(hf_shapes[0])) if self.transposed else tuple(hf_shapes[0])

    def hf_shapes(self, mg_shape, shape):
        return [tuple(reversed(mg_shape)) if self.transposed else tuple(mg_shape)]


class FuseGatedQKV(ParamRule):
    """Gated attention (Qwen3-Next): the query projection emits, per head, the query then its output
    gate (``[q_h; gate_h]``); megatron's ``linear_qkv`` with ``attention_output_gate`` holds per
    query group its query heads, then their gate heads, then the key head and the value head."""

    def __init__(self, mg: str, q: str, k: str, v: str, layers: str = "all") -> None:
        super().__init__(mg, (q, k, v), layers)

    @staticmethod
    def _sizes(shape: ModelShape) -> tuple[int, int, int]:
        groups = shape.num_query_groups
        return groups, shape.num_attention_heads // groups, shape.kv_channels

    def to_megatron(self, tensors, shape):
        q, k, v = tensors
        groups, per, d = self._sizes(shape)
        rest = q.shape[1:]
        q = q.reshape(groups, per, 2, d, *rest)
        fused = torch.cat(
            [
                q[:, :, 0].reshape(groups, per * d, *rest),
                q[:, :, 1].reshape(groups, per * d, *rest),
                k.reshape(groups, d, *rest),
                v.reshape(groups, d, *rest),
            ],
            dim=1,
        )
        return fused.reshape(-1, *rest)

    def to_hf(self, tensor, shape):
        groups, per, d = self._sizes(shape)
        rest = tensor.shape[1:]
        query, gate, k, v = tensor.reshape(groups, 2 * per * d + 2 * d, *rest).split([per * d, per * d, d, d], dim=1)
        q = torch.stack([query.reshape(groups, per, d, *rest), gate.reshape(groups, per, d, *rest)], dim=2)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]

    def megatron_shape(self, hf_shapes, shape):
        groups, per, d = self._sizes(shape)
        expected = [(groups * per * 2 * d,), (groups * d,), (groups * d,)]
        for got, want, role in zip(hf_shapes, expected, "qkv"):
            if tuple(got[:1]) != want or tuple(got[1:]) != tuple(hf_shapes[0][1:]):
                raise ValueError(
                    f"{role} has shape {tuple(got)} but num_attention_heads={shape.num_attention_heads} (each with "
                    f"its gate), num_key_value_heads={groups}, head_dim={d} give {want[0]} rows"
                )
        return (groups * (2 * per + 2) * d, *hf_shapes[0][1:])

    def hf_shapes(self, mg_shape, shape):
        groups, per, d = self._sizes(shape)
        rest = tuple(mg_shape[1:])
        return [(groups * per * 2 * d, *rest), (groups * d, *rest), (groups * d, *rest)]


class FuseDeltaNetInProj(ParamRule):
    """Gated DeltaNet's input projections: transformers' ``in_proj_qkvz`` (per key head: its query,
    key, and its value heads' values and output gates) and ``in_proj_ba`` (per key head: its value
    heads' ``b`` then ``a``) as megatron's ``in_proj`` ``[q | k | v | z | b | a]`` (heads in order)."""

    def __init__(self, mg: str, qkvz: str, ba: str, layers: str = "linear") -> None:
        super().__init__(mg, (qkvz, ba), layers)

    @staticmethod
    def _sizes(shape: ModelShape) -> tuple[int, list[int], list[int]]:
        groups = shape.linear_num_key_heads
        ratio = shape.linear_num_value_heads // groups
        key, value = shape.linear_key_head_dim, ratio * shape.linear_value_head_dim
        return groups, [key, key, value, value], [ratio, ratio]

    def to_megatron(self, tensors, shape):
        qkvz, ba = tensors
        groups, cuts, ba_cuts = self._sizes(shape)
        rest = qkvz.shape[1:]
        parts = qkvz.reshape(groups, sum(cuts), *rest).split(cuts, dim=1)
        parts += ba.reshape(groups, sum(ba_cuts), *rest).split(ba_cuts, dim=1)
        return torch.cat([part.reshape(-1, *rest) for part in parts])

    def to_hf(self, tensor, shape):
        groups, cuts, ba_cuts = self._sizes(shape)
        rest = tensor.shape[1:]
        parts = [part.reshape(groups, -1, *rest) for part in tensor.split([groups * c for c in cuts + ba_cuts])]
        return [torch.cat(parts[:4], dim=1).reshape(-1, *rest), torch.cat(parts[4:], dim=1).reshape(-1, *rest)]

    def megatron_shape(self, hf_shapes, shape):
        groups, cuts, ba_cuts = self._sizes(shape)
        for got, rows, name in zip(
            hf_shapes, (groups * sum(cuts), groups * sum(ba_cuts)), ("in_proj_qkvz", "in_proj_ba")
        ):
            if got[0] != rows:
                raise ValueError(
                    f"{name} has shape {tuple(got)} but linear_num_key_heads={groups}, linear_num_value_heads="
                    f"{shape.linear_num_value_heads} and the linear head dims give {rows} rows"
                )
        return (groups * (sum(cuts) + sum(ba_cuts)), *hf_shapes[0][1:])

    def hf_shapes(self, mg_shape, shape):
        groups, cuts, ba_cuts = self._sizes(shape)
        rest = tuple(mg_shape[1:])
        return [(groups * sum(cuts), *rest), (groups * sum(ba_cuts), *rest)]
