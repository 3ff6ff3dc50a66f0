"""Rotary position embedding: ``rotary_pos_emb`` and the ``rotary_cos_sin`` tables it consumes.

``rotary_pos_emb(x, cos, sin, interleaved=False)`` rotates the first ``rot_dim = cos.shape[-1]``
channels of every head of ``x`` (``[..., head_dim]``, any leading layout such as ``[s, b, n, d]``
or ``[b, s, n, d]``); the remaining channels pass through unchanged (partial rotary). ``cos``
and ``sin`` broadcast against ``x[..., :rot_dim]``.

Two channel layouts are in use:

* half (``interleaved=False``; Llama, Hugging Face, Megatron's default): channel ``i`` pairs
  with channel ``i + rot_dim / 2``, ``out = x * cos + rotate_half(x) * sin`` with
  ``rotate_half(x) = cat(-x2, x1)``;
* interleaved (GPT-J, Megatron's ``rotary_interleaved``): channel ``2i`` pairs with ``2i + 1``,
  ``out = x * cos + rotate_interleaved(x) * sin`` with pairs ``(a, b) -> (-b, a)``.

:func:`rotary_cos_sin` builds ``cos``/``sin`` in the layout each mode expects. The rotation is
computed in fp32 for half-precision inputs and returned in ``x.dtype``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mindspeed.ops.registry import Case, OpSpec, register_kernel, register_op

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in _HALF_DTYPES else x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` where ``x1, x2`` are the halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Each channel pair ``(x[2i], x[2i+1])`` becomes ``(-x[2i+1], x[2i])``."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def check_rotary_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Validate the shapes of a rotary call and return ``rot_dim``.

    Raises:
        ValueError: if ``cos`` and ``sin`` differ in shape, or ``rot_dim`` is odd or larger
            than the head dimension.
    """
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_pos_emb: cos {list(cos.shape)} and sin {list(sin.shape)} must have one shape")
    rot_dim = cos.shape[-1]
    if rot_dim % 2 != 0 or rot_dim > x.shape[-1] or rot_dim == 0:
        raise ValueError(
            f"rotary_pos_emb: rot_dim = cos.shape[-1] = {rot_dim} must be even, positive and at most "
            f"the head dimension x.shape[-1] = {x.shape[-1]}"
        )
    return rot_dim


def rotary_pos_emb_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x``.

    Args:
        x: ``[..., head_dim]`` queries or keys, any leading layout.
        cos: cosines, broadcastable to ``x[..., :rot_dim]`` (e.g. ``[s, 1, 1, rot_dim]`` for
            ``[s, b, n, d]``), in the layout of the chosen mode (see :func:`rotary_cos_sin`).
        sin: sines, same shape as ``cos``.
        interleaved: pairs are adjacent channels (GPT-J) instead of the two halves.

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    rot_dim = check_rotary_inputs(x, cos, sin)
    x_rot = _upcast(x[..., :rot_dim])
    rotate = rotate_interleaved if interleaved else rotate_half
    out = (x_rot * _upcast(cos) + rotate(x_rot) * _upcast(sin)).to(x.dtype)
    if rot_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot_dim:]), dim=-1)


def rotary_cos_sin(
    positions_or_seq_len: int | torch.Tensor,
    rot_dim: int,
    base: float = 10000.0,
    interleaved: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of the standard RoPE frequencies ``base ** (-2i / rot_dim)``.

    Args:
        positions_or_seq_len: a sequence length (positions ``0 .. n-1``) or a tensor of
            positions of any shape (e.g. ``[b, s]`` position ids of packed sequences).
        rot_dim: number of rotated channels (even).
        base: the RoPE base (``theta``).
        interleaved: produce the interleaved layout ``[f0, f0, f1, f1, ...]`` instead of the
            half layout ``[f0, f1, ..., f0, f1, ...]``.
        dtype: dtype of the returned tables (the angles are computed in fp32).
        device: where to build them (default: the positions' device, else the CPU).

    Returns:
        ``(cos, sin)``, each ``[seq, rot_dim]`` (``[*positions.shape, rot_dim]`` for a tensor).

    Raises:
        ValueError: if ``rot_dim`` is odd or not positive.
    """
    if rot_dim <= 0 or rot_dim % 2 != 0:
        raise ValueError(f"rotary_cos_sin: rot_dim must be even and positive, got {rot_dim}")
    if isinstance(positions_or_seq_len, torch.Tensor):
        positions = positions_or_seq_len.to(device=device or positions_or_seq_len.device, dtype=torch.float32)
    else:
        positions = torch.arange(int(positions_or_seq_len), device=device, dtype=torch.float32)
    exponents = torch.arange(0, rot_dim, 2, device=positions.device, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / (base**exponents)
    angles = positions[..., None] * inv_freq  # [..., rot_dim / 2]
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotary_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def make(x_shape: tuple[int, ...], table_shape: tuple[int, ...], interleaved: bool = False) -> tuple:
        x = torch.randn(x_shape, generator=gen).to(device, dtype)
        seq, rot_dim = table_shape[0], table_shape[-1]
        # Random positions (not 0..s-1) so that no angle is trivially zero.
        positions = torch.randint(0, 4096, (seq,), generator=gen)
        cos, sin = rotary_cos_sin(positions, rot_dim, interleaved=interleaved, dtype=dtype)
        view = (seq, *table_shape[1:-1], rot_dim)
        return x, cos.reshape(view).to(device), sin.reshape(view).to(device)

    def bnsd() -> tuple:
        # Hugging Face style: per-batch position ids, tables [b, 1, s, d] against x [b, n, s, d].
        x = torch.randn(2, 3, 5, 8, generator=gen).to(device, dtype)
        positions = torch.randint(0, 512, (2, 5), generator=gen)
        cos, sin = rotary_cos_sin(positions, 8, dtype=dtype)
        return x, cos[:, None].to(device), sin[:, None].to(device)

    return [
        Case("sbnd", make((7, 2, 3, 16), (7, 1, 1, 16))),
        Case("bsnd tables [s, 1, d]", make((2, 5, 3, 32), (5, 1, 32))),
        Case("bnsd per-batch positions", bnsd()),
        Case("partial rotary", make((5, 2, 2, 24), (5, 1, 1, 16))),
        Case("3d odd", make((9, 3, 10), (9, 1, 10))),
        Case("interleaved", make((6, 2, 3, 16), (6, 1, 1, 16), interleaved=True), {"interleaved": True}),
        Case("interleaved partial", make((3, 2, 2, 20), (3, 1, 1, 12), interleaved=True), {"interleaved": True}),
    ]


def _rotary_bench(dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(1024, 2, 16, 128, device=device, dtype=dtype)
    cos, sin = rotary_cos_sin(1024, 128, dtype=dtype, device=device)
    return Case("s1024 b2 n16 d128", (x, cos[:, None, None], sin[:, None, None]))


register_op(
    OpSpec(
        name="rotary_pos_emb",
        reference=rotary_pos_emb_reference,
        doc="Rotary position embedding, half or interleaved layout, partial rotary",
        cases=_rotary_cases,
        bench_case=_rotary_bench,
    )
)


class _RotaryHalf(torch.autograd.Function):
    """The half layout written into one output, without ``rotate_half``'s negation and
    concatenation (nor the pass-through concatenation of a partial rotary): with halves
    ``x1, x2`` of the rotated channels and ``cos = [c1 | c2]``, ``sin = [s1 | s2]``,
    ``out1 = x1 c1 - x2 s1`` and ``out2 = x2 c2 + x1 s2`` (two ``mul`` and two ``addcmul`` into
    views of the output); the backward is the transposed rotation, written the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(cos, sin)
        return _rotate_halves(x, cos, sin, sign=1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: D102
        cos, sin = ctx.saved_tensors
        return _rotate_halves(grad, cos, sin, sign=-1.0), None, None


def _broadcast_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """``torch.broadcast_shapes(a, b)`` in plain Python (torch's goes through its symbolic-shape
    guards: ~0.3 ms a call, about 14 % of a tiny model's decode step on the CPU)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    if any(x != y and x != 1 and y != 1 for x, y in zip(a, b)):
        raise ValueError(f"rotary_pos_emb: the tables' shape {list(b)} does not broadcast against {list(a)}")
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    # sign 1: the rotation (out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2); sign -1: its transpose
    # (the input gradient: g1 c1 + g2 s2, g2 c2 - g1 s1).
    rot_dim = cos.shape[-1]
    half = rot_dim // 2
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    x1, x2 = x[..., :half], x[..., half:rot_dim]
    out = torch.empty(_broadcast_shape(x.shape, (*cos.shape[:-1], x.shape[-1])), dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:rot_dim]
    if sign > 0:
        torch.mul(x1, c1, out=out1).addcmul_(x2, s1, value=-1.0)
        torch.mul(x2, c2, out=out2).addcmul_(x1, s2)
    else:
        torch.mul(x1, c1, out=out1).addcmul_(x2, s2)
        torch.mul(x2, c2, out=out2).addcmul_(x1, s1, value=-1.0)
    if rot_dim < x.shape[-1]:
        out[..., rot_dim:] = x[..., rot_dim:]
    return out


# Not traceable: dynamo refuses ``out=`` into the output's non-contiguous views (the reference runs under compile).
@register_kernel("rotary_pos_emb", "native", priority=5, traceable=False)
def rotary_pos_emb_native(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """The reference's half layout in four fused multiply(-add)s into one output (:class:`_RotaryHalf`);
    half-precision inputs, the interleaved layout and differentiable tables take the reference."""
    check_rotary_inputs(x, cos, sin)
    if interleaved or x.dtype in _HALF_DTYPES or cos.dtype != x.dtype or cos.requires_grad or sin.requires_grad:
        return rotary_pos_emb_reference(x, cos, sin, interleaved)
    if _broadcast_shape(x.shape[:-1], cos.shape[:-1]) != tuple(x.shape[:-1]):
        return rotary_pos_emb_reference(x, cos, sin, interleaved)  # tables wider than x: the reference's shape
    return _RotaryHalf.apply(x, cos, sin)
