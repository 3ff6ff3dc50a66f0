"""The compiled decode step of the built-in engine (``compile=True``): one ``torch.compile`` graph per batch bucket.

An eager decode step is one Python pass over the layers per token: on small models and the CPU
the kernel launches, the Python around them and the unfused element-wise ops (norms, rotary,
SwiGLU, residual adds, the attention's padding) cost as much as the GEMMs. Here the whole step,
embedding to logits, is one graph (``fullgraph=True``, static shapes), so dynamo's guard check
replaces the Python and Inductor fuses the element-wise work.

Shapes are made static by buckets: a step of ``n`` running requests runs the graph of the
smallest bucket ``>= n`` (powers of two up to ``max_batch_size``, and ``max_batch_size``),
the rows past ``n`` padded (token 0 at position 0 of a free cache slot, whose contents the next
prefill or slot move rewrites). Positions are a tensor input, and the attended length (the
longest running sequence; shorter rows' empty positions carry the cache's ``-inf`` key bias,
:class:`~.cache.KVCache`) is the graph's one dynamic dimension, so one graph serves every step
of a bucket, whatever the lengths; a new graph is compiled only for a new bucket (or, at most,
a cache of another size: a call that needs a longer one). The prefill stays eager, as does sampling, so
tokens, log-probabilities and random streams are those of the eager step up to the
floating-point order Inductor picks.
"""

from __future__ import annotations

import torch

from mindspeed.compile import MODES, CompileWatch, compile_mode
from mindspeed.log import get_logger
from mindspeed.ops.registry import OPS
from mindspeed_llm.inference.cache import Attention, KVCache, Mix
from mindspeed_llm.inference.model import Decoder

logger = get_logger("mindspeed_llm.inference.engine")


def decode_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: powers of two below ``max_batch_size``, then ``max_batch_size``."""
    buckets, size = [], 1
    while size < max_batch_size:
        buckets.append(size)
        size *= 2
    return (*buckets, max_batch_size)


def check_compilable(model: Decoder) -> None:
    """Refuse a model whose decode step has data-dependent Python (routed experts, linear attention).

    Raises:
        ValueError: the model has routed experts or Gated DeltaNet layers.
    """
    shape = model.spec.shape
    if shape.num_experts:
        raise ValueError(
            f"compile=True needs a dense model; {model.spec.family} routes tokens to experts "
            "(a data-dependent loop): run it with compile off"
        )
    if shape.linear_attention_freq:
        raise ValueError(
            f"compile=True does not cover linear-attention layers ({model.spec.family}): run it with compile off"
        )


class StaticDecodeStep:
    """:class:`~.cache.DecodeStep` inside the compiled graph: the bucket's rows, one token each.

    The new keys and values are written with one ``index_put_`` into the graph's cache input (not
    into a per-layer view of it): Inductor then writes them in place, where a mutated view of a
    graph input costs a copy of the cache per layer.

    Args:
        attention: the registry attention kernel.
        scale: softmax scale.
        keys: ``[layers, rows, length, kv_heads, head_dim + 1]``: the bucket's slots of the cache, up to
            the attended length.
        values: the same for values.
        positions: ``[rows]`` position of each new token.
    """

    def __init__(
        self, attention: Attention, scale: float, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        self.attention, self.scale, self.keys, self.values = attention, scale, keys, values
        self.rows = positions.shape[0]
        self.slots = torch.arange(self.rows, device=positions.device)
        self.positions = positions

    def mix(self, layer: int, x: torch.Tensor, mix: Mix) -> torch.Tensor:
        raise NotImplementedError("linear-attention layers are not compiled (check_compilable)")

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer (same contract as :meth:`~.cache.DecodeStep.attend`)."""
        rows, kv_heads, group, dim = qk.shape[0], qk.shape[1], qk.shape[2] - 1, qk.shape[3]
        index = (torch.full_like(self.slots, layer), self.slots, self.positions)
        self.keys.index_put_(index, torch.constant_pad_nd(qk[:, :, group], (0, 1)))
        self.values.index_put_(index, torch.constant_pad_nd(v, (0, 1)))
        keys, values = self.keys[layer, :rows], self.values[layer, :rows]
        if sinks is not None:
            query = torch.constant_pad_nd(qk[:, :, :group].reshape(rows, 1, kv_heads * group, dim), (0, 1), 1.0)
            out = self.attention(query, keys, values, causal=False, softmax_scale=self.scale, sinks=sinks)
            return out[..., :dim].reshape(rows, kv_heads * group * dim)
        query = torch.constant_pad_nd(qk[:, :, :group].transpose(1, 2), (0, 1), 1.0)
        out = self.attention(query, keys, values, causal=False, softmax_scale=self.scale)
        return out[..., :dim].transpose(1, 2).reshape(rows, kv_heads * group * dim)


class CompiledDecode:
    """The decode step of an engine under ``torch.compile``, one graph per batch bucket.

    Args:
        model: the engine's decoder (its weights are read in place: weight updates need no recompile).
        max_batch_size: the engine's slots (the largest bucket).
        mode: a ``mindspeed.compile.MODES`` key (``True``: ``default``).

    Raises:
        ValueError: an unknown mode, or a model :func:`check_compilable` refuses.
    """

    def __init__(self, model: Decoder, max_batch_size: int, mode: bool | str = True) -> None:
        if mode is not True and mode not in MODES:
            raise ValueError(f"compile={mode!r}: use True, False or a mode ({', '.join(MODES)})")
        check_compilable(model)
        self.mode = compile_mode(mode)
        self.model = model.traceable()
        # One query per head attends over a few hundred keys: the math form, which Inductor fuses
        # into the step, measured 1.3-1.6x faster per step on the CPU than the SDPA kernel (which
        # Inductor calls as an opaque kernel); the prefill keeps the engine's kernel.
        self._attention = OPS.get("attention").reference
        self.buckets = decode_buckets(max_batch_size)
        self.watch = CompileWatch()
        self._graph = torch.compile(self._forward, mode=MODES[self.mode], fullgraph=True)
        # Every bucket (and every cache size) is a new graph of the same code: room for all of them. Shapes
        # are static but for the attended length (marked dynamic), never made dynamic by a recompile.
        # No duck sizing: a length that happens to equal another size (head_dim + 1) must not tie them.
        self._config = (
            torch._dynamo.config.patch(recompile_limit=4 * len(self.buckets) + 8, automatic_dynamic_shapes=False),
            torch.fx.experimental._config.patch(use_duck_shape=False),
        )

        self._compiled: set[tuple] = set()  # (bucket, cache strides, dtype) already run under the settings above

    def bucket(self, rows: int) -> int:
        """The smallest bucket holding ``rows`` requests."""
        return next(size for size in self.buckets if size >= rows)

    def logits(self, cache: KVCache, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]`` of one decode step of the requests in slots ``0 .. rows-1``.

        Args:
            cache: the engine's cache (at least :meth:`bucket` slots).
            tokens: each running request's last token.
            positions: each one's position (= its cached tokens).
        """
        rows, device = len(tokens), self.model.device
        size = self.bucket(rows)
        pad = [0] * (size - rows)
        tokens_t = torch.tensor(tokens + pad, device=device)
        positions_t = torch.tensor(positions + pad, device=device)
        if cache.window_layers:  # data-dependent masking of keys leaving a window: eager, before the graph
            cache.slide_windows(torch.arange(rows, device=device), positions_t[:rows])
        # The attended length: the longest running sequence, a dynamic dimension of one graph.
        length = max(positions) + 1
        keys, values = cache.keys[:, :size, :length], cache.values[:, :size, :length]
        layout = (size, keys.stride(), cache.keys.dtype)
        if layout in self._compiled:  # its graph exists: no config to set (~50 us a step on the CPU)
            return self._graph(tokens_t, positions_t, keys, values)[:rows]
        torch._dynamo.mark_dynamic(keys, 2)
        torch._dynamo.mark_dynamic(values, 2)
        graphs, seconds = self.watch.graphs(), self.watch.seconds()
        with self._config[0], self._config[1]:
            logits = self._graph(tokens_t, positions_t, keys, values)
        self._compiled.add(layout)
        logger.info(
            "compiled decode step: bucket %d (%d graph(s), %.1f s); %d graph(s), %.1f s in all",
            size,
            self.watch.graphs() - graphs,
            self.watch.seconds() - seconds,
            self.watch.graphs(),
            self.watch.seconds(),
        )
        return logits[:rows]

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        model = self.model
        step = StaticDecodeStep(self._attention, model.scale, keys, values, positions)
        return model.logits(model.hidden(tokens, positions, step))
