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
a cache of another size: a call that needs a longer one). The prefill stays eager, as does sampling of one-step calls, so
tokens, log-probabilities and random streams are those of the eager step up to the
floating-point order Inductor picks.

Two CPU levers on top (:class:`CompiledDecode`): the GEMMs of buckets of at least 4 rows multiply
by MKL-packed weights (:mod:`.packed`), and when every running request has room for them, another
graph per bucket runs :data:`DEFAULT_CHUNK` steps per call with the token choice inside (the argmax,
:meth:`CompiledDecode.greedy_steps`, or the eager sampler's draw, :meth:`CompiledDecode.sampled_steps`),
which pays the call's guards and Python once per chunk.
"""

from __future__ import annotations

import torch

from mindspeed.compile import MODES, CompileWatch, compile_mode
from mindspeed.log import get_logger
from mindspeed.ops.registry import OPS
from mindspeed_llm.inference.cache import Attention, KVCache, Mix
from mindspeed_llm.inference.model import Decoder
from mindspeed_llm.inference.packed import (
    AUTO_MAX_BYTES,
    PACK_MIN_ROWS,
    PackedLinear,
    decode_weights,
    estimate_bytes,
    mkl_packing_available,
)
from mindspeed_llm.inference.sampling import sample_static

logger = get_logger("mindspeed_llm.inference.engine")


#: Decode steps per call of the chunk graphs (:meth:`CompiledDecode.greedy_steps`, :meth:`CompiledDecode.sampled_steps`).
DEFAULT_CHUNK = 4


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
        prepack: multiply by MKL-packed weights (:mod:`.packed`; CPU, fp32): ``None`` (default) where
            available and the packs (a copy of the weights per bucket, several times their size) take at most
            :data:`~.packed.AUTO_MAX_BYTES`; ``True`` where available whatever their size; ``False``: never.
        chunk: decode steps per call of the chunk graphs (:meth:`greedy_steps`, :meth:`sampled_steps`; 1: one step a
            call, sampling outside the graph).

    Raises:
        ValueError: an unknown mode, or a model :func:`check_compilable` refuses.
    """

    def __init__(
        self,
        model: Decoder,
        max_batch_size: int,
        mode: bool | str = True,
        prepack: bool | None = None,
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk={chunk}: the decode steps per call of the chunk graphs must be at least 1")
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
        self.packed = self._pack(prepack)
        if self.packed is not None:
            self.model.linear = self.packed
        self.watch = CompileWatch()
        self._graph = torch.compile(self._forward, mode=MODES[self.mode], fullgraph=True)
        self.chunk = chunk
        self._chunk_graph = (
            torch.compile(self._forward_chunk, mode=MODES[self.mode], fullgraph=True) if chunk > 1 else None
        )
        self._sampled_graph = (
            torch.compile(self._forward_sampled, mode=MODES[self.mode], fullgraph=True) if chunk > 1 else None
        )
        # Every bucket (and every cache size) is a new graph of the same code: room for all of them. Shapes
        # are static but for the attended length (marked dynamic), never made dynamic by a recompile.
        # No duck sizing: a length that happens to equal another size (head_dim + 1) must not tie them.
        self._config = (
            torch._dynamo.config.patch(recompile_limit=4 * len(self.buckets) + 8, automatic_dynamic_shapes=False),
            torch.fx.experimental._config.patch(use_duck_shape=False),
        )

        self._compiled: set[tuple] = (
            set()
        )  # (graph, steps, bucket, cache strides, dtype) already run with the settings above

    def _pack(self, prepack: bool | None) -> PackedLinear | None:
        model = self.model
        if prepack is False or not mkl_packing_available(model.device, model.dtype):
            return None
        rows = [size for size in self.buckets if size >= PACK_MIN_ROWS]
        if not rows:
            return None
        weights = decode_weights(model)
        size = estimate_bytes(weights, len(rows))
        if prepack is None and size > AUTO_MAX_BYTES:
            logger.info(
                "compiled decode step: weights not prepacked (the packs would take %.1f GB, over %.1f GB)",
                size / 1e9,
                AUTO_MAX_BYTES / 1e9,
            )
            return None
        packed = PackedLinear(weights, rows)
        logger.info("compiled decode step: %d weights prepacked for MKL (%.0f MB)", len(packed.packs), size / 1e6)
        return packed

    def weights_changed(self) -> None:
        """Refresh what the graphs derive from the weights (the packs) after they changed in place."""
        if self.packed is not None:
            self.packed.repack()

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
        if cache.window_layers:  # data-dependent masking of keys leaving a window: eager, before the graph
            positions_t = torch.tensor(positions, device=device)
            cache.slide_windows(torch.arange(rows, device=device), positions_t)
        return self._call(self._graph, cache, tokens, positions, 1)[:rows]

    def greedy_steps(
        self, cache: KVCache, tokens: list[int], positions: list[int], steps: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``steps`` greedy decode steps in one graph call: each row's tokens and their log-probabilities.

        Each step's token is the argmax of its logits and feeds the next step, inside the graph (as
        :meth:`~.sampling.Sampler.sample` picks it: the first of equal maxima; its log-probability is the
        log-softmax of the logits there). One call replaces ``steps`` calls' dynamo guard checks, Python
        and sampling outside the graph. The caller discards a row's tokens after a stop token (their keys
        sit past the request's end, in a slot that a prefill or slot move rewrites before reuse).

        Args:
            cache: the engine's cache (no sliding-window layers: their masking runs between steps).
            tokens: each running request's last token.
            positions: each one's position; every row must have room for ``steps`` more tokens in the cache.
            steps: :attr:`chunk` (the graph is compiled for it).
        """
        if steps != self.chunk or cache.window_layers:
            raise ValueError(f"greedy_steps runs chunks of {self.chunk} steps without sliding windows, got {steps}")
        rows = len(tokens)
        chosen, logprobs = self._call(self._chunk_graph, cache, tokens, positions, steps)
        return chosen[:rows].tolist(), logprobs[:rows].tolist()

    def sampled_steps(
        self, cache: KVCache, tokens: list[int], positions: list[int], steps: int, settings: SampleSettings
    ) -> tuple[list[list[int]], list[list[float]]]:
        """As :meth:`greedy_steps`, each step's token drawn inside the graph as the eager sampler draws it
        (:func:`~.sampling.sample_static`: temperature, top-k, top-p, the request's counter-based noise).

        Args:
            settings: per running row, its sampling settings and noise state (:class:`SampleSettings`).
        """
        if steps != self.chunk or cache.window_layers:
            raise ValueError(f"sampled_steps runs chunks of {self.chunk} steps without sliding windows, got {steps}")
        rows = len(tokens)
        size = self.bucket(rows)
        chosen, logprobs = self._call(self._sampled_graph, cache, tokens, positions, steps, settings.tensors(size))
        return chosen[:rows].tolist(), logprobs[:rows].tolist()

    def _call(self, graph, cache: KVCache, tokens: list[int], positions: list[int], steps: int, extra=()):
        rows, device = len(tokens), self.model.device
        size = self.bucket(rows)
        pad = [0] * (size - rows)
        tokens_t = torch.tensor(tokens + pad, device=device)
        positions_t = torch.tensor(positions + pad, device=device)
        # The attended length: the longest running sequence (after the call's last step), a dynamic
        # dimension of one graph; shorter rows' later positions carry the cache's -inf key bias.
        length = max(positions) + steps
        keys, values = cache.keys[:, :size, :length], cache.values[:, :size, :length]
        layout = (graph, steps, size, keys.stride(), cache.keys.dtype)
        if layout in self._compiled:  # its graph exists: no config to set (~50 us a step on the CPU)
            return graph(tokens_t, positions_t, keys, values, *extra)
        torch._dynamo.mark_dynamic(keys, 2)
        torch._dynamo.mark_dynamic(values, 2)
        graphs, seconds = self.watch.graphs(), self.watch.seconds()
        with self._config[0], self._config[1]:
            out = graph(tokens_t, positions_t, keys, values, *extra)
        self._compiled.add(layout)
        logger.info(
            "compiled decode step: bucket %d, %d step(s) a call (%d graph(s), %.1f s); %d graph(s), %.1f s in all",
            size,
            steps,
            self.watch.graphs() - graphs,
            self.watch.seconds() - seconds,
            self.watch.graphs(),
            self.watch.seconds(),
        )
        return out

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        model = self.model
        step = StaticDecodeStep(self._attention, model.scale, keys, values, positions)
        return model.logits(model.hidden(tokens, positions, step))

    def _forward_chunk(
        self, tokens: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, logprobs = [], []
        for offset in range(self.chunk):
            logits = self._forward(tokens, positions + offset, keys, values)
            tokens = logits.argmax(dim=-1)
            chosen.append(tokens)
            logprobs.append(logits.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0])
        return torch.stack(chosen, dim=1), torch.stack(logprobs, dim=1)

    def _forward_sampled(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        *settings: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sampled, temperature, top_k, top_p, noise_keys, counters = settings
        chosen, logprobs = [], []
        for offset in range(self.chunk):
            logits = self._forward(tokens, positions + offset, keys, values)
            tokens, logprob = sample_static(logits, sampled, temperature, top_k, top_p, noise_keys, counters + offset)
            chosen.append(tokens)
            logprobs.append(logprob)
        return torch.stack(chosen, dim=1), torch.stack(logprobs, dim=1)


class SampleSettings:
    """The running rows' sampling settings and noise state, as the sampled chunk graph takes them.

    Args:
        params: per row, its :class:`~.sampling.SamplingParams`.
        keys: per row, its noise key (``None``: greedy).
        steps: per row, the tokens it has drawn so far.
        device: where the graph runs.
    """

    def __init__(self, params: list, keys: list[int | None], steps: list[int], device: torch.device) -> None:
        self.params, self.keys, self.steps, self.device = params, keys, steps, device

    def tensors(self, size: int) -> tuple[torch.Tensor, ...]:
        """``(sampled, temperature, top_k, top_p, keys, steps)``, padded to ``size`` rows (greedy padding)."""
        pad = size - len(self.params)
        greedy = [p.greedy for p in self.params] + [True] * pad
        make = lambda values, dtype: torch.tensor(values, dtype=dtype, device=self.device)  # noqa: E731
        return (
            make([not g for g in greedy], torch.bool),
            make([1.0 if p.greedy else p.temperature for p in self.params] + [1.0] * pad, torch.float32),
            make([p.top_k for p in self.params] + [0] * pad, torch.int64),
            make([p.top_p for p in self.params] + [1.0] * pad, torch.float32),
            make([k or 0 for k in self.keys] + [0] * pad, torch.int64),
            make(self.steps + [0] * pad, torch.int64),
        )
