"""The single-device decoder the inference engine runs: Llama-like families, dense or MoE,
DeepSeek-V3 (multi-latent attention, :mod:`.mla`; sigmoid routing, :mod:`.routing`; shared experts;
dense first layers) and Gemma 3 ((1 + w) norms before and after attention and MLP, GeGLU, a scaled
embedding, a second rope base on the sliding-window layers, soft-capped logits).

Weights are held under megatron-core's names and in its fused layouts (``linear_qkv`` in the
grouped ``[group: q heads, k, v]`` layout, ``linear_fc1`` as ``[gate; up]``), which is what
the bridges produce from Hugging Face tensors and what a Megatron checkpoint stores: both load
by plain copies (:meth:`Decoder.tensors`). Experts of a layer are stacked in one tensor (each
expert's megatron name is a view of it).

Every kernel comes from the registry (``rms_norm``, ``rotary_pos_emb``, ``attention``,
``swiglu``), resolved once when the model is built, so vendor kernels plug in unchanged. The
attention of a forward is delegated to a step object (:mod:`.cache`): no cache, prefill into
cache slots, or one decode token per slot.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from mindspeed.ops import resolve_kernel
from mindspeed.ops.gated_delta_net import DeltaNetHeads, gated_delta_net_mix
from mindspeed.ops.registry import OPS
from mindspeed_llm.bridges import megatron_params
from mindspeed_llm.inference.cache import AttentionStep, RecurrentStates
from mindspeed_llm.inference.mla import MLAAttention
from mindspeed_llm.inference.routing import route
from mindspeed_llm.inference.spec import DecoderSpec

#: Registry ops the decoder uses.
KERNEL_OPS = ("rms_norm", "rotary_pos_emb", "attention", "swiglu")
#: The :class:`Decoder` attribute holding each op's kernel.
_KERNEL_ATTRS = {"rms_norm": "rms_norm", "rotary_pos_emb": "rotary", "attention": "attention", "swiglu": "swiglu"}


def _geglu(x: torch.Tensor) -> torch.Tensor:
    # [gate; up] halves, as megatron's linear_fc1 holds them; transformers' gelu_pytorch_tanh.
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _clamped_quick_geglu(limit: float | None, offset: float):
    """GPT-OSS's SwiGLU: ``(clamp(up) + offset) * g * sigmoid(1.702 g)``, ``g`` the gate clamped above."""

    def activation(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + offset) * (gate * torch.sigmoid(gate * 1.702))

    return activation


class DecoderLayer:
    """One layer's weights (views into the model's tensors) and its forward.

    Args:
        model: the decoder that owns the kernels.
        index: the layer index.
        weights: megatron name -> tensor of the whole model.
    """

    def __init__(self, model: Decoder, index: int, weights: dict[str, torch.Tensor]) -> None:
        prefix = f"decoder.layers.{index}."
        get = lambda name: weights.get(prefix + name)  # noqa: E731
        self.model, self.index = model, index
        self.attn_norm = get("input_layernorm.weight")
        self.qkv_weight = get("self_attention.linear_qkv.weight")
        self.qkv_bias = get("self_attention.linear_qkv.bias")
        self.q_norm = get("self_attention.q_layernorm.weight")
        self.k_norm = get("self_attention.k_layernorm.weight")
        self.proj = get("self_attention.linear_proj.weight")
        self.proj_bias = get("self_attention.linear_proj.bias")
        self.sinks = get("self_attention.core_attention.softmax_offset")  # GPT-OSS's per-head sink logits
        self.mlp_norm = get("pre_mlp_layernorm.weight")
        # Gemma's norms of the attention and MLP outputs (mindspeed.megatron.variants' names).
        self.post_attn_norm = get("self_attention.linear_proj.post_layernorm.weight")
        self.post_mlp_norm = get("mlp.linear_fc2.post_layernorm.weight")
        self.fc1 = get("mlp.linear_fc1.weight")
        self.fc2 = get("mlp.linear_fc2.weight")
        self.fc1_bias, self.fc2_bias = get("mlp.linear_fc1.bias"), get("mlp.linear_fc2.bias")
        self.router = get("mlp.router.weight")
        self.router_bias = get("mlp.router.bias")
        self.expert_bias = get("mlp.router.expert_bias")
        self.shared_fc1 = get("mlp.shared_experts.linear_fc1.weight")
        self.shared_fc2 = get("mlp.shared_experts.linear_fc2.weight")
        self.shared_gate = get("mlp.shared_experts.gate_weight")  # Qwen2-MoE's shared_expert_gate
        if self.router is not None:
            stacks = model.expert_stacks
            self.fc1, self.fc2 = stacks["linear_fc1.weight"][index], stacks["linear_fc2.weight"][index]
            self.fc1_bias = stacks.get("linear_fc1.bias", {}).get(index)
            self.fc2_bias = stacks.get("linear_fc2.bias", {}).get(index)
        self.mla = MLAAttention(model, get) if model.spec.shape.multi_latent_attention else None
        # Gated DeltaNet (Qwen3-Next's linear attention) in megatron's layout.
        self.in_proj = get("self_attention.in_proj.weight")
        if self.in_proj is not None:
            self.conv, self.a_log = get("self_attention.conv1d.weight"), get("self_attention.A_log")
            self.dt_bias, self.out_norm = get("self_attention.dt_bias"), get("self_attention.out_norm.weight")
            self.out_proj = get("self_attention.out_proj.weight")

    def _mixer(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        if self.in_proj is not None:
            return self._linear_attention(h, step)
        return self.mla.forward(h, cos, sin, self.index, step) if self.mla else self._attention(h, cos, sin, step)

    def _linear_attention(self, h: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        # The mixer runs over sequences (rows) the step lays out, from and into its carried states.
        m = self.model

        def mix(x: torch.Tensor, conv: torch.Tensor | None, state: torch.Tensor | None, keep: bool):
            return gated_delta_net_mix(
                x,
                m.delta_net_heads,
                self.conv,
                self.a_log,
                self.dt_bias,
                lambda y: m.rms_norm(y, self.out_norm, m.spec.norm_eps),  # a plain weight, not 1 + w
                m.gated_delta_rule,
                conv,
                state,
                keep,
            )

        return F.linear(step.mix(self.index, F.linear(h, self.in_proj), mix), self.out_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        """``x`` ``[tokens, hidden]`` -> the layer's output, same shape (``cos``/``sin`` ``[tokens, 1, 1, dim]``)."""
        m = self.model
        h = m.norm(x, self.attn_norm)
        attention = self._mixer(h, cos, sin, step)
        if self.post_attn_norm is not None:
            attention = m.norm(attention, self.post_attn_norm)
        x = x + attention
        h = m.norm(x, self.mlp_norm)
        mlp = (
            self._experts(h)
            if self.router is not None
            else self._mlp(h, self.fc1, self.fc2, self.fc1_bias, self.fc2_bias)
        )
        if self.post_mlp_norm is not None:
            mlp = m.norm(mlp, self.post_mlp_norm)
        return x + mlp

    def _mlp(
        self, h: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, b1: torch.Tensor | None = None, b2=None
    ) -> torch.Tensor:
        linear = self.model.linear
        return linear(self.model.activation(linear(h, fc1, b1)), fc2, b2)

    def _attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        m, spec = self.model, self.model.spec
        group = spec.group_size
        gates = group if spec.shape.attention_output_gate else 0  # Qwen3-Next: gate heads after the queries
        qkv = m.linear(h, self.qkv_weight, self.qkv_bias).view(
            h.shape[0], spec.num_kv_heads, group + gates + 2, spec.head_dim
        )
        # [tokens, kv_heads, group + 1, dim]: each group's query heads then its key head, rotated in one call.
        qk = qkv[:, :, : group + 1] if not gates else torch.cat((qkv[:, :, :group], qkv[:, :, -2:-1]), dim=2)
        if self.q_norm is not None:
            qk = torch.cat((m.norm(qk[:, :, :group], self.q_norm), m.norm(qk[:, :, group:], self.k_norm)), dim=2)
        qk = m.rotary(qk, cos, sin)
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        out = step.attend(self.index, qk, qkv[:, :, -1], **extra)
        if gates:
            out = out * torch.sigmoid(qkv[:, :, group : 2 * group].reshape(out.shape))
        return m.linear(out, self.proj, self.proj_bias)

    def _experts(self, tokens: torch.Tensor) -> torch.Tensor:
        # The routed experts (transformers' routing, :mod:`.routing`), plus the shared experts
        # (scaled by sigmoid(x @ gate.T) where the family has megatron's moe_shared_expert_gate).
        m = self.model
        weights, chosen = route(tokens, self.router, self.expert_bias, m.spec.shape, self.router_bias)
        out = torch.zeros_like(tokens)
        counts = torch.bincount(chosen.flatten(), minlength=self.fc1.shape[0]).tolist()
        for expert, count in enumerate(counts):
            if not count:
                continue
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            biases = [None if b is None else b[expert] for b in (self.fc1_bias, self.fc2_bias)]
            y = self._mlp(tokens[token], self.fc1[expert], self.fc2[expert], *biases)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        if self.shared_fc1 is not None:
            shared = self._mlp(tokens, self.shared_fc1, self.shared_fc2)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(tokens, self.shared_gate))
            out = out + shared
        return out


class Decoder:
    """A Llama-like decoder (dense or MoE) on one device, weights under megatron names.

    Args:
        spec: the model.
        dtype: parameter and activation dtype.
        device: where weights and activations live.
        kernels: op -> registry implementation (default ``"auto"`` for each of :data:`KERNEL_OPS`).
    """

    def __init__(
        self, spec: DecoderSpec, dtype: torch.dtype, device: torch.device, kernels: dict[str, str] | None = None
    ) -> None:
        self.spec, self.dtype, self.device = spec, dtype, device
        impls = {op: "auto" for op in KERNEL_OPS} | (kernels or {})
        # The resolved implementations (:meth:`traceable` swaps the ones dynamo cannot trace).
        self.kernel_impls = {op: resolve_kernel(op, impls[op]) for op in KERNEL_OPS}
        if self.kernel_impls["swiglu"].name == "native" and impls["swiglu"] == "auto":
            # 'native' is the reference's math behind a custom autograd function that saves
            # activation memory for the backward pass; without a backward it only adds overhead.
            self.kernel_impls["swiglu"] = resolve_kernel("swiglu", "reference")
        for op, attr in _KERNEL_ATTRS.items():
            setattr(self, attr, self.kernel_impls[op].fn)
        self._set_activation()
        # The dense GEMMs (q/k/v, output projection, MLP, output layer): the compiled decode step
        # swaps in prepacked weights (:mod:`.packed`).
        self.linear = F.linear
        shape = spec.shape
        # Gemma: norms scale by 1 + w; embeddings by sqrt(hidden) (in the model dtype, as
        # transformers does); logits soft-capped.
        self.norm_offset = 1.0 if shape.apply_layernorm_1p else 0.0
        self.embedding_scale = shape.embedding_multiplier_scale
        self.softcap = shape.output_logit_softcapping
        self.scale = spec.softmax_scale
        self.inv_freq = spec.inv_freq.to(device)
        self.local_inv_freq = None if spec.local_inv_freq is None else spec.local_inv_freq.to(device)
        self.local_rope_layers = spec.local_rope_layers
        if shape.linear_attention_freq:  # Qwen3-Next's Gated DeltaNet layers
            impl = impls.get("gated_delta_rule", "auto")
            self.gated_delta_rule = resolve_kernel("gated_delta_rule", impl).fn
            self.delta_net_heads = DeltaNetHeads(
                shape.linear_num_key_heads,
                shape.linear_num_value_heads,
                shape.linear_key_head_dim,
                shape.linear_value_head_dim,
            )
        self._weights = self._allocate()
        self.embedding = self._weights["embedding.word_embeddings.weight"]
        self.final_norm = self._weights["decoder.final_layernorm.weight"]
        self.output = self._weights.get("output_layer.weight", self.embedding)
        self.layers = [DecoderLayer(self, i, self._weights) for i in range(spec.num_layers)]

    def _set_activation(self) -> None:
        shape = self.spec.shape
        self.activation = _geglu if shape.geglu else self.swiglu
        if shape.quick_geglu:
            self.activation = _clamped_quick_geglu(shape.activation_clamp, shape.glu_linear_offset)

    def traceable(self) -> Decoder:
        """This decoder (the same weight tensors) with kernels ``torch.compile`` can trace: an
        implementation registered ``traceable=False`` is replaced by its op's reference, which
        Inductor then fuses (as :class:`~mindspeed.ops.registry.KernelImpl` does under ``train.compile``)."""
        clone = copy.copy(self)
        for op, attr in _KERNEL_ATTRS.items():
            if not self.kernel_impls[op].traceable:
                setattr(clone, attr, OPS.get(op).reference)
        clone._set_activation()
        clone.layers = [DecoderLayer(clone, i, self._weights) for i in range(self.spec.num_layers)]
        return clone

    def _allocate(self) -> dict[str, torch.Tensor]:
        shape = self.spec.shape
        empty = lambda size: torch.zeros(size, dtype=self.dtype, device=self.device)  # noqa: E731
        params = megatron_params(shape)
        weights: dict[str, torch.Tensor] = {}
        # Experts of a layer share one stacked tensor per parameter (``linear_fc1.weight`` ...);
        # their megatron names are views of it.
        self.expert_stacks: dict[str, dict[int, torch.Tensor]] = {}
        for name, param in params.items():
            if param.expert is None:
                weights[name] = empty(param.shape)
                continue
            stack = self.expert_stacks.setdefault(name.split(".local_experts.")[1].split(".", 1)[1], {})
            if param.layer not in stack:
                stack[param.layer] = empty((shape.num_experts, *param.shape))
            weights[name] = stack[param.layer][param.expert]
        return weights

    def recurrent_states(self, num_slots: int) -> RecurrentStates | None:
        """Empty carried states of the linear-attention layers for ``num_slots`` sequences (``None``: none)."""
        shape = self.spec.shape
        if not shape.linear_attention_freq:
            return None
        heads = self.delta_net_heads
        return RecurrentStates(
            [i for i in range(shape.num_layers) if shape.is_linear_layer(i)],
            num_slots,
            (heads.conv_channels, shape.linear_conv_kernel_dim - 1),
            (heads.value_heads, heads.key_dim, heads.value_dim),
            self.dtype,
            self.device,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Megatron name -> the tensor holding it (copy into it to change the weights)."""
        return dict(self._weights)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm of ``x`` (by ``weight``, or ``1 + weight`` for zero-centred weights)."""
        # 1 + w in fp32, as transformers' Gemma RMSNorm computes it (bf16 would round w away).
        return self.rms_norm(x, weight.float() + self.norm_offset if self.norm_offset else weight, self.spec.norm_eps)

    def rope(self, positions: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[*positions.shape, head_dim]`` in the model dtype (transformers' arithmetic);
        ``local``: of the sliding-window layers' own base."""
        angles = positions[..., None].float() * (self.local_inv_freq if local else self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        scale = self.spec.local_rope_scale if local else self.spec.rope_scale
        return (angles.cos() * scale).to(self.dtype), (angles.sin() * scale).to(self.dtype)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        """Final hidden states (before the last norm) ``[tokens, hidden]``.

        Args:
            tokens: token ids ``[tokens]`` (the step knows how they form sequences).
            positions: their positions ``[tokens]``.
            step: how attention reaches keys and values (:mod:`.cache`).
        """
        x = F.embedding(tokens, self.embedding)
        if self.embedding_scale is not None:
            x = x * torch.tensor(self.embedding_scale, dtype=torch.float32).to(x.dtype)
        tables = {}
        for local in sorted(set(self.local_rope_layers)):
            cos, sin = self.rope(positions, local)
            tables[local] = cos[:, None, None], sin[:, None, None]  # against [tokens, kv_heads, group + 1, dim]
        for layer, local in zip(self.layers, self.local_rope_layers):
            x = layer.forward(x, *tables[local], step)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[..., vocab]`` of final hidden states."""
        logits = self.linear(self.norm(hidden, self.final_norm), self.output)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()
