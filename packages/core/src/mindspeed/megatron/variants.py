"""Layer and model variants megatron-core's GPT spec cannot express, added through its seams.

Gemma-style models (Gemma 2 / 3) differ from megatron's GPT layer in four places, each brought
in without editing megatron:

- post-norms: the attention and MLP outputs are normalised before the residual add. Module specs
  name :class:`VariantSelfAttention` and :class:`PostNormMLP` (megatron's ``SelfAttention`` and
  ``MLP`` plus a ``post_layernorm``) in place of megatron's classes;
- a second rope base: the sliding-window layers rotate with ``local_rotary_base``;
  :class:`VariantSelfAttention` of such a layer swaps the model's rotary table for its own
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
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import is_layer_window_attention

from mindspeed.model.shape import ModelShape


def _post_norm(config: Any, spec: ModuleSpec | None) -> Any:
    if spec is None:
        return None
    return build_module(spec, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


def _normed(module: torch.nn.Module, output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
    out, bias = output
    if module.post_layernorm is None:
        return out, bias
    if bias is not None:
        raise ValueError("a post-norm needs the bias inside the normalised output; set add_bias_linear=False")
    return module.post_layernorm(out), None


class VariantSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` with an optional post-norm of its output and, on
    sliding-window layers, its own rope base.

    Args:
        post_norm: the norm's spec (``None``: no post-norm); built as ``post_layernorm``.
        local_rotary_base: rope theta of the sliding-window layers (``None``: the model's table).
        *args, **kwargs: megatron's ``SelfAttention`` arguments.
    """

    def __init__(
        self, *args: Any, post_norm: ModuleSpec | None = None, local_rotary_base: float | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        self.post_layernorm = _post_norm(config, post_norm)
        self.local_rope = None
        local = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        if local_rotary_base is not None and local:
            if config.context_parallel_size > 1:
                raise ValueError("a local rope base is not supported under context parallelism; use cp=1")
            self.local_rope = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=1.0,
                rotary_interleaved=config.rotary_interleaved,
                rotary_base=local_rotary_base,
                use_cpu_initialization=config.use_cpu_initialization,
            )

    def forward(self, hidden_states: torch.Tensor, *args: Any, rotary_pos_emb: Any = None, **kwargs: Any) -> Any:
        if self.local_rope is not None and rotary_pos_emb is not None:
            # The model's table covers the whole (unsplit: cp == 1) sequence, packed or not.
            length = (rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb).shape[0]
            rotary_pos_emb = self.local_rope(length)
        output = super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        return _normed(self, output)


class PostNormMLP(MLP):
    """megatron's ``MLP`` whose output is normalised (``post_layernorm``) before the residual add.

    Args:
        post_norm: the norm's spec.
        *args, **kwargs: megatron's ``MLP`` arguments.
    """

    def __init__(self, *args: Any, post_norm: ModuleSpec | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.post_layernorm = _post_norm(self.config, post_norm)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _normed(self, super().forward(hidden_states, *args, **kwargs))


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
    post = norm if shape.post_norm else None
    if post is None and shape.local_rotary_base is None:
        return spec
    sub.self_attention.module = VariantSelfAttention
    sub.self_attention.params = {
        **(sub.self_attention.params or {}),
        "post_norm": post,
        "local_rotary_base": shape.local_rotary_base,
    }
    if post is not None:
        if sub.mlp.module is not MLP:
            raise ValueError("post-norms are implemented for dense MLP layers only, not for MoE layers")
        sub.mlp.module = PostNormMLP
        sub.mlp.params = {**(sub.mlp.params or {}), "post_norm": post}
    return spec


def add_model_variants(model: Any, shape: ModelShape) -> Any:
    """Hook the embedding scale and the logit soft-cap of ``shape`` into a built ``GPTModel`` chunk.

    The scale multiplies the embedding output by ``embedding_multiplier_scale`` in the
    activation dtype (as transformers' Gemma does); the soft-cap maps the output layer's logits
    (vocabulary-parallel shards: elementwise) to ``cap * tanh(logits / cap)``.
    """
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
