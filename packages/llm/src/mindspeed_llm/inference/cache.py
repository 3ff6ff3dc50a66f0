"""The KV cache and the three ways a forward pass reaches keys and values.

:class:`KVCache` preallocates keys and values for ``num_slots`` sequences of up to ``max_len``
tokens, every layer in one tensor ``[layers, slots, max_len, kv_heads, head_dim + 1]`` (a view of
head-major storage). Running sequences occupy slots ``0 .. n-1`` (the engine keeps them packed),
so one decode step attends over the plain slice ``[:n, :kv_len]``.

Sequences in a batch have different lengths, and the registry's attention op takes no per-row
key mask. The cache closes that gap with one extra channel: a key's last channel is 0 where
the position holds a key and ``-inf`` where it does not (past the sequence's end, or out of its
sliding window), and a decode query gets a last channel of 1. ``q . k`` then gains exactly 0
on visible keys and ``-inf`` on the others, so the unmasked kernel (whatever backend
``resolve_kernel("attention")`` chose) computes the masked attention of every row at once;
the score is scaled explicitly by ``1 / sqrt(head_dim)``.

The steps (:class:`CausalStep`, :class:`PrefillStep`, :class:`DecodeStep`) are what a layer
calls with its queries, keys and values; the model code is the same for all three.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

Attention = Callable[..., torch.Tensor]


class AttentionStep(Protocol):
    """What a layer hands its rotated queries and keys and its values to."""

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output ``[tokens, heads * head_dim]`` of ``qk`` ``[tokens, kv_heads, group + 1, head_dim]``
        (each group's query heads, then its key head) and ``v`` ``[tokens, kv_heads, head_dim]``."""
        ...


#: What a linear-attention layer hands a step: ``mix(x, conv_state, recurrent_state, keep_state)`` ->
#: ``(out, conv_state, recurrent_state)`` over ``x`` ``[rows, seq, width]`` (see
#: :func:`mindspeed.ops.gated_delta_net.gated_delta_net_mix`).
Mix = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


class RecurrentStates:
    """The carried state of the linear-attention (Gated DeltaNet) layers, per layer and slot: the
    convolution's last ``K - 1`` inputs and the delta-rule state (fp32).

    Args:
        layers: the linear-attention layers.
        num_slots: sequences held at once.
        conv_shape: ``(channels, K - 1)``.
        state_shape: ``(value_heads, key_dim, value_dim)``.
        dtype: dtype of the convolution inputs (the model's).
        device: where they live.
    """

    def __init__(
        self,
        layers: Sequence[int],
        num_slots: int,
        conv_shape: tuple[int, int],
        state_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.index = {layer: i for i, layer in enumerate(layers)}
        self.conv = torch.zeros(len(layers), num_slots, *conv_shape, dtype=dtype, device=device)
        self.state = torch.zeros(len(layers), num_slots, *state_shape, dtype=torch.float32, device=device)

    def write(self, layer: int, slots: slice, conv: torch.Tensor, state: torch.Tensor) -> None:
        """Store the states of ``slots`` after a step of ``layer``."""
        self.conv[self.index[layer], slots] = conv
        self.state[self.index[layer], slots] = state

    def read(self, layer: int, slots: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of ``slots`` before a step of ``layer``."""
        return self.conv[self.index[layer], slots], self.state[self.index[layer], slots]

    def move(self, source: int, target: int) -> None:
        """Copy slot ``source``'s states into slot ``target``."""
        self.conv[:, target] = self.conv[:, source]
        self.state[:, target] = self.state[:, source]

    @property
    def nbytes(self) -> int:
        """Bytes of both states."""
        return self.conv.numel() * self.conv.element_size() + self.state.numel() * self.state.element_size()


class KVCache:
    """Keys and values of up to ``num_slots`` sequences, every layer in one tensor.

    ``keys`` and ``values`` are ``[layers, slots, max_len, kv_heads, head_dim + 1]`` views.

    Args:
        num_layers: decoder layers.
        num_slots: sequences held at once.
        max_len: tokens per sequence.
        num_kv_heads: key/value heads.
        head_dim: width of one head.
        windows: per layer, its sliding window (``None``: full attention).
        dtype: dtype of the cache (the model's).
        device: where it lives.
        recurrent: the linear-attention layers' states (:class:`RecurrentStates`, the same slots),
            moved with the keys and values.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        windows: Sequence[int | None],
        dtype: torch.dtype,
        device: torch.device,
        recurrent: RecurrentStates | None = None,
    ) -> None:
        self.num_slots, self.max_len, self.head_dim = num_slots, max_len, head_dim
        self.recurrent = recurrent
        # Stored head-major ([..., kv_heads, max_len, dim]: one head's keys are contiguous, as
        # attention kernels read them) and used through sequence-major views, the op's BSND layout.
        size = (num_layers, num_slots, num_kv_heads, max_len, head_dim + 1)
        self.keys = torch.zeros(size, dtype=dtype, device=device).transpose(2, 3)
        self.values = torch.zeros(size, dtype=dtype, device=device).transpose(2, 3)
        self.keys[..., head_dim] = float("-inf")  # every position starts empty
        # window -> the layers that use it (masking is one indexed write per window size)
        self.window_layers: dict[int, torch.Tensor] = {}
        for window in sorted({w for w in windows if w}):
            layers = [i for i, w in enumerate(windows) if w == window]
            self.window_layers[window] = torch.tensor(layers, device=device)

    def fits(self, num_slots: int, max_len: int, dtype: torch.dtype) -> bool:
        """Whether this cache can serve ``num_slots`` sequences of ``max_len`` tokens in ``dtype``."""
        return self.num_slots >= num_slots and self.max_len >= max_len and self.keys.dtype == dtype

    def close_rows(self, start: int, lengths: Sequence[int]) -> None:
        """After a prefill into slots ``start ..``: positions past each sequence's length hold no key,
        and positions already out of a sliding window of the next query are masked."""
        bias = self.keys[..., self.head_dim]
        for offset, length in enumerate(lengths):
            bias[:, start + offset, length:] = float("-inf")
            for window, layers in self.window_layers.items():
                if length > window:
                    bias[layers, start + offset, : length - window] = float("-inf")

    def slide_windows(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Before a decode step whose queries sit at ``positions``: the key ``window`` places back
        leaves the window of each windowed layer."""
        for window, layers in self.window_layers.items():
            leaving = positions - window
            keep = leaving >= 0
            if bool(keep.any()):
                self.keys[layers[:, None], rows[keep][None, :], leaving[keep][None, :], :, self.head_dim] = float(
                    "-inf"
                )

    def move(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``source`` into slot ``target`` (which is then
        that sequence's slot); the rest of ``target`` is marked empty."""
        self.keys[:, target, :length] = self.keys[:, source, :length]
        self.values[:, target, :length] = self.values[:, source, :length]
        self.keys[:, target, length:, :, self.head_dim] = float("-inf")
        if self.recurrent is not None:
            self.recurrent.move(source, target)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values (and recurrent states)."""
        extra = 0 if self.recurrent is None else self.recurrent.nbytes
        return 2 * self.keys.numel() * self.keys.element_size() + extra


class CausalStep:
    """No cache: the tokens are ``rows`` sequences of ``seq`` tokens (right-padded), causal attention.

    Right padding needs no mask: a real token's causal window holds only real tokens.

    Args:
        attention: the registry attention kernel.
        windows: per layer, its sliding window.
        scale: softmax scale.
        rows: sequences.
        seq: tokens per sequence (padded).
    """

    def __init__(self, attention: Attention, windows: Sequence[int | None], scale: float, rows: int, seq: int) -> None:
        self.attention, self.windows, self.scale, self.rows, self.seq = attention, windows, scale, rows, seq

    def split(self, qk: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """BSND ``q``, ``k``, ``v`` from the flat ``qk`` ``[tokens, kv_heads, group + 1, dim]`` and ``v``."""
        kv_heads, group, dim = qk.shape[1], qk.shape[2] - 1, qk.shape[3]
        qk = qk.view(self.rows, self.seq, kv_heads, group + 1, dim)
        q = qk[:, :, :, :group].reshape(self.rows, self.seq, kv_heads * group, dim)
        return q, qk[:, :, :, group], v.reshape(self.rows, self.seq, kv_heads, dim)

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer.

        Args:
            layer: the layer index.
            qk: rotated queries and keys ``[tokens, kv_heads, group + 1, head_dim]`` (each group's
                query heads, then its key head).
            v: values ``[tokens, kv_heads, head_dim]``.
            sinks: ``[heads]`` sink logits of the layer (GPT-OSS; ``None``: none).

        Returns:
            ``[tokens, heads * head_dim]``.
        """
        return self._attend(layer, *self.split(qk, v), sinks)

    def mix(self, layer: int, x: torch.Tensor, mix: Mix) -> torch.Tensor:
        """A linear-attention layer's mixer over ``x`` ``[tokens, width]`` from zero state, row by row
        (right padding follows the real tokens, so they do not see it); ``[tokens, out]``."""
        out, _, _ = mix(x.view(self.rows, self.seq, -1), None, None, False)
        return out.reshape(self.rows * self.seq, -1)

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        window = self.windows[layer]
        extra = {} if sinks is None else {"sinks": sinks}
        out = self.attention(
            q, k, v, causal=True, softmax_scale=self.scale, window_size=(window - 1, 0) if window else (-1, -1), **extra
        )
        return out.reshape(self.rows * self.seq, -1)


class PrefillStep(CausalStep):
    """Causal attention over new prompts (right-padded rows) that also fills their cache slots.

    Args:
        attention: the registry attention kernel.
        windows: per layer, its sliding window.
        scale: softmax scale.
        rows: prompts.
        seq: tokens per prompt (padded).
        cache: the cache.
        start: slot of the first row (rows go to ``start, start + 1, ...``).
        lengths: each row's prompt length (default ``seq``): a linear-attention layer's state is
            the one after the row's last real token.
    """

    def __init__(
        self,
        attention: Attention,
        windows: Sequence[int | None],
        scale: float,
        rows: int,
        seq: int,
        cache: KVCache,
        start: int,
        lengths: Sequence[int] | None = None,
    ) -> None:
        super().__init__(attention, windows, scale, rows, seq)
        self.cache, self.start = cache, start
        self.lengths = list(lengths) if lengths is not None else [seq] * rows

    def mix(self, layer: int, x: torch.Tensor, mix: Mix) -> torch.Tensor:
        """As :meth:`CausalStep.mix`, each row over its real tokens, keeping its states in its slot
        (the outputs at padding positions are zeros)."""
        rows = x.view(self.rows, self.seq, -1)
        outputs = []
        for row, length in enumerate(self.lengths):
            out, conv, state = mix(rows[row : row + 1, :length], None, None, True)
            self.cache.recurrent.write(layer, slice(self.start + row, self.start + row + 1), conv, state)
            outputs.append(torch.constant_pad_nd(out, (0, 0, 0, self.seq - length)))
        return torch.cat(outputs).reshape(self.rows * self.seq, -1)

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(qk, v)
        end = self.start + self.rows
        # Padding positions are written too and closed afterwards (KVCache.close_rows).
        self.cache.keys[layer, self.start : end, : self.seq] = torch.constant_pad_nd(k, (0, 1))
        self.cache.values[layer, self.start : end, : self.seq] = torch.constant_pad_nd(v, (0, 1))
        return self._attend(layer, q, k, v, sinks)


class DecodeStep:
    """One new token per running slot ``0 .. rows-1``, attending to its cached keys.

    Args:
        attention: the registry attention kernel.
        scale: softmax scale.
        cache: the cache.
        positions: ``[rows]`` position of each new token (= tokens already cached in its slot).
        kv_len: one more than the largest position.
    """

    def __init__(
        self, attention: Attention, scale: float, cache: KVCache, positions: torch.Tensor, kv_len: int
    ) -> None:
        rows = positions.shape[0]
        self.attention, self.scale, self.cache, self.running = attention, scale, cache, rows
        self.index = (torch.arange(rows, device=positions.device), positions)
        cache.slide_windows(self.index[0], positions)
        # Per layer, the [rows, kv_len] block every query of this step attends over (views).
        self.keys = cache.keys[:, :rows, :kv_len].unbind(0)
        self.values = cache.values[:, :rows, :kv_len].unbind(0)

    def mix(self, layer: int, x: torch.Tensor, mix: Mix) -> torch.Tensor:
        """A linear-attention layer's mixer on one token per slot, from and back into the slot's states."""
        slots = slice(0, self.running)
        conv, state = self.cache.recurrent.read(layer, slots)
        out, conv, state = mix(x.view(self.running, 1, -1), conv, state, True)
        self.cache.recurrent.write(layer, slots, conv, state)
        return out.reshape(self.running, -1)

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer (same contract as :meth:`CausalStep.attend`, one token per row)."""
        rows, kv_heads, group, dim = qk.shape[0], qk.shape[1], qk.shape[2] - 1, qk.shape[3]
        keys, values = self.keys[layer], self.values[layer]
        keys.index_put_(self.index, torch.constant_pad_nd(qk[:, :, group], (0, 1)))
        values.index_put_(self.index, torch.constant_pad_nd(v, (0, 1)))
        if sinks is not None:
            # Sinks are per query head: one query position, every head (the kernel's GQA serves them).
            query = torch.constant_pad_nd(qk[:, :, :group].reshape(rows, 1, kv_heads * group, dim), (0, 1), 1.0)
            out = self.attention(query, keys, values, causal=False, softmax_scale=self.scale, sinks=sinks)
            return out[..., :dim].reshape(rows, kv_heads * group * dim)
        # The group's query heads play the role of query positions ([rows, group, kv_heads, dim]):
        # each kv head then serves its own queries without repeating keys and values.
        query = torch.constant_pad_nd(qk[:, :, :group].transpose(1, 2), (0, 1), 1.0)
        out = self.attention(query, keys, values, causal=False, softmax_scale=self.scale)
        return out[..., :dim].transpose(1, 2).reshape(rows, kv_heads * group * dim)
