"""Layer and model variants megatron-core's GPT spec cannot express, added through its seams.

Gemma-style models (Gemma 2 / 3) differ from megatron's GPT layer in four places, each brought
in without editing megatron:

- post-norms: the attention and MLP outputs are normalised before the residual add. The layer
  spec names :class:`PostNormRowParallelLinear` (megatron's ``RowParallelLinear`` plus a
  ``post_layernorm``) as the attention's ``linear_proj`` and the MLP's ``linear_fc2``, so
  megatron's ``SelfAttention`` and ``MLP`` stay as they are (and get their process groups);
- a second rope base: the sliding-window layers rotate with ``local_rotary_base``;
  :class:`LocalRopeSelfAttention` of such a layer swaps the model's rotary table for its own
  (megatron's ``RotaryEmbedding``, built for the same sequence length);
- the embedding scale and the final logit soft-cap: forward hooks on the built ``GPTModel``'s
  embedding and output layer (:func:`add_model_variants`), the only seam megatron has there.

(1 + w) norms, the score scale and the per-layer window are megatron's own
``TransformerConfig`` fields (``layernorm_zero_centered_gamma``, ``softmax_scale``,
``window_size`` / ``window_attn_skip_freq``), which the registry modules honour.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import is_layer_window_attention

from mindspeed.model.shape import ModelShape


class PostNormRowParallelLinear(RowParallelLinear):
    """megatron's ``RowParallelLinear`` whose output is normalised (``post_layernorm``): as the
    attention's ``linear_proj`` and the MLP's ``linear_fc2``, Gemma's norms after attention and
    MLP, before the residual add (the output is whole per token, under sequence parallelism too).

    Args:
        post_norm: the norm's spec, built for the output width.
        *args, **kwargs: megatron's ``RowParallelLinear`` arguments.
    """

    def __init__(self, input_size: int, output_size: int, *args: Any, post_norm: ModuleSpec, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, *args, **kwargs)
        self.post_layernorm = build_module(
            post_norm, config=self.config, hidden_size=output_size, eps=self.config.layernorm_epsilon
        )
        # A hook, not a forward override: it normalises the module's final output, so a LoRA
        # mixin put in front of the class later adds its term before the norm, as peft does.
        self.register_forward_hook(_apply_post_norm)


def _apply_post_norm(module: PostNormRowParallelLinear, args: Any, output: tuple[torch.Tensor, Any]) -> Any:
    out, bias = output
    if bias is not None:
        raise ValueError("a post-norm needs the bias inside the normalised output; set add_bias_linear=False")
    return module.post_layernorm(out), None


class LocalRopeSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` that rotates with its own rope base on sliding-window layers.

    Args:
        local_rotary_base: rope theta of the sliding-window layers.
        rotary_percent: the fraction of a head's channels that rotate (the model's).
        *args, **kwargs: megatron's ``SelfAttention`` arguments.
    """

    def __init__(self, *args: Any, local_rotary_base: float, rotary_percent: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        self.local_rope = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):
            if config.context_parallel_size > 1:
                raise ValueError("a local rope base is not supported under context parallelism; use cp=1")
            self.local_rope = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                rotary_base=local_rotary_base,
                use_cpu_initialization=config.use_cpu_initialization,
            )

    def forward(self, hidden_states: torch.Tensor, *args: Any, rotary_pos_emb: Any = None, **kwargs: Any) -> Any:
        if self.local_rope is not None and rotary_pos_emb is not None:
            # The model's table covers the whole (unsplit: cp == 1) sequence, packed or not.
            length = (rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb).shape[0]
            rotary_pos_emb = self.local_rope(length)
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def apply_layer_variants(spec: ModuleSpec, shape: ModelShape, norm: ModuleSpec) -> ModuleSpec:
    """Put the variant modules ``shape`` needs into a dense GPT layer spec (in place; returned).

    Args:
        spec: a layer spec of megatron's GPT layer (``SelfAttention``, ``MLP``).
        shape: the model (``post_norm``, ``local_rotary_base``).
        norm: the spec of the post-norms (the layer's own norm).

    Raises:
        ValueError: a post-norm on MoE layers (not implemented).
    """
    sub = spec.submodules
    if shape.local_rotary_base is not None:
        sub.self_attention.module = LocalRopeSelfAttention
        sub.self_attention.params = {
            **(sub.self_attention.params or {}),
            "local_rotary_base": shape.local_rotary_base,
            "rotary_percent": shape.rotary_percent,
        }
    if shape.post_norm:
        mlp = sub.mlp.submodules
        if not hasattr(mlp, "linear_fc2"):
            raise ValueError("post-norms are implemented for dense MLP layers only, not for MoE layers")
        post = {"post_norm": norm}
        sub.self_attention.submodules.linear_proj = ModuleSpec(module=PostNormRowParallelLinear, params=post)
        mlp.linear_fc2 = ModuleSpec(module=PostNormRowParallelLinear, params=post)
    return spec


#: The embedding norm's module name under ``GPTModel.embedding`` (BLOOM's ``word_embeddings_layernorm``).
EMBEDDING_NORM = "word_embeddings_layernorm"


def add_model_variants(model: Any, shape: ModelShape, norm: ModuleSpec | None = None) -> Any:
    """Hook the embedding norm and scale and the logit soft-cap of ``shape`` into a built ``GPTModel`` chunk.

    The embedding norm (``shape.embedding_layernorm``, built from ``norm``) becomes the
    embedding's submodule :data:`EMBEDDING_NORM`, so its parameters are the model's
    (``embedding.word_embeddings_layernorm.weight``) and it normalises the embedding output
    (whole per token, under sequence parallelism too). The scale multiplies the embedding
    output by ``embedding_multiplier_scale`` in the activation dtype (as transformers' Gemma
    does); the soft-cap maps the output layer's logits (vocabulary-parallel shards:
    elementwise) to ``cap * tanh(logits / cap)``.
    """
    if shape.embedding_layernorm and getattr(model, "pre_process", False):
        if norm is None:
            raise ValueError("an embedding norm needs the norm's spec: add_model_variants(model, shape, norm)")
        config = model.config
        model.embedding.add_module(
            EMBEDDING_NORM,
            build_module(norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon),
        )
        model.embedding.register_forward_hook(lambda module, args, out: getattr(module, EMBEDDING_NORM)(out))
    scale = shape.embedding_multiplier_scale
    if scale is not None and getattr(model, "pre_process", False):
        model.embedding.register_forward_hook(
            lambda module, args, out: out * torch.tensor(scale, dtype=torch.float32).to(out.dtype)
        )
    cap = shape.output_logit_softcapping
    if cap is not None and getattr(model, "post_process", False):

        def softcap(module: Any, args: Any, out: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
            logits, bias = out
            return torch.tanh(logits / cap) * cap, bias

        model.output_layer.register_forward_hook(softcap)
    return model
