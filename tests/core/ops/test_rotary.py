"""rotary_pos_emb and rotary_cos_sin against Hugging Face's Llama RoPE and complex rotations."""

from __future__ import annotations

import types

import pytest
import torch

from mindspeed.ops.rotary import rotary_cos_sin, rotary_pos_emb_reference


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _complex_rotation(pairs_real: torch.Tensor, pairs_imag: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the complex numbers ``real + i imag`` by ``angles``; returns ``[..., 2]`` (real, imag)."""
    z = torch.view_as_complex(torch.stack((pairs_real, pairs_imag), dim=-1).double().contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles.double()), angles.double()))


def _angles(positions: torch.Tensor, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    return positions.double()[..., None] * inv_freq


def test_half_layout_matches_hugging_face_llama() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    batch, heads, seq, head_dim = 2, 3, 6, 16
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    q = torch.randn(batch, heads, seq, head_dim, generator=_gen(0))
    k = torch.randn(batch, heads, seq, head_dim, generator=_gen(1))
    position_ids = torch.randint(0, 2048, (batch, seq), generator=_gen(2))
    hf_cos, hf_sin = llama.LlamaRotaryEmbedding(config)(q, position_ids)
    cos, sin = rotary_cos_sin(position_ids, head_dim, base=500000.0)
    torch.testing.assert_close(cos, hf_cos)
    torch.testing.assert_close(sin, hf_sin)
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, hf_cos, hf_sin, unsqueeze_dim=1)
    torch.testing.assert_close(rotary_pos_emb_reference(q, cos[:, None], sin[:, None]), hf_q)
    torch.testing.assert_close(rotary_pos_emb_reference(k, cos[:, None], sin[:, None]), hf_k)
    # The same rotation in Megatron's [s, b, n, d] layout with [s, 1, 1, d] tables.
    positions = torch.arange(seq)
    cos, sin = rotary_cos_sin(seq, head_dim, base=500000.0)
    hf_cos, hf_sin = llama.LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, _ = llama.apply_rotary_pos_emb(q, k, hf_cos, hf_sin, unsqueeze_dim=1)
    sbnd = rotary_pos_emb_reference(q.permute(2, 0, 1, 3), cos[:, None, None], sin[:, None, None])
    torch.testing.assert_close(sbnd.permute(1, 2, 0, 3), hf_q)


def test_half_layout_is_a_complex_rotation_of_channel_i_with_i_plus_half() -> None:
    seq, batch, heads, rot_dim = 5, 2, 3, 12
    x = torch.randn(seq, batch, heads, rot_dim, generator=_gen(3), dtype=torch.float64)
    # Positions below 64: the fp32 angles of rotary_cos_sin stay within 1e-5 of exact ones.
    positions = torch.randint(0, 64, (seq,), generator=_gen(4))
    cos, sin = rotary_cos_sin(positions, rot_dim, dtype=torch.float64)
    out = rotary_pos_emb_reference(x, cos[:, None, None], sin[:, None, None])
    half = rot_dim // 2
    rotated = _complex_rotation(x[..., :half], x[..., half:], _angles(positions, rot_dim)[:, None, None])
    torch.testing.assert_close(out, torch.cat((rotated[..., 0], rotated[..., 1]), dim=-1), atol=1e-5, rtol=1e-5)


def test_interleaved_layout_is_a_complex_rotation_of_adjacent_channels() -> None:
    seq, batch, heads, head_dim = 7, 2, 2, 16
    x = torch.randn(seq, batch, heads, head_dim, generator=_gen(5))
    positions = torch.randint(0, 64, (seq,), generator=_gen(6))
    cos, sin = rotary_cos_sin(positions, head_dim, interleaved=True)
    out = rotary_pos_emb_reference(x, cos[:, None, None], sin[:, None, None], interleaved=True)
    expected = _complex_rotation(x[..., 0::2], x[..., 1::2], _angles(positions, head_dim)[:, None, None])
    torch.testing.assert_close(out.double(), expected.flatten(-2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_passes_the_other_channels_through(interleaved: bool) -> None:
    x = torch.randn(4, 2, 3, 24, generator=_gen(7))
    cos, sin = rotary_cos_sin(4, 16, interleaved=interleaved)
    cos, sin = cos[:, None, None], sin[:, None, None]
    out = rotary_pos_emb_reference(x, cos, sin, interleaved=interleaved)
    assert torch.equal(out[..., 16:], x[..., 16:])
    torch.testing.assert_close(out[..., :16], rotary_pos_emb_reference(x[..., :16], cos, sin, interleaved))


@pytest.mark.parametrize("interleaved", [False, True])
def test_attention_scores_depend_only_on_relative_positions(interleaved: bool) -> None:
    q = torch.randn(8, generator=_gen(8), dtype=torch.float64)
    k = torch.randn(8, generator=_gen(9), dtype=torch.float64)
    cos, sin = rotary_cos_sin(torch.tensor([3, 10, 33, 40]), 8, interleaved=interleaved, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        rot_q = rotary_pos_emb_reference(q, cos[m], sin[m], interleaved)
        rot_k = rotary_pos_emb_reference(k, cos[n], sin[n], interleaved)
        return rot_q @ rot_k

    torch.testing.assert_close(score(1, 0), score(3, 2), atol=1e-5, rtol=1e-5)  # 10 - 3 == 40 - 33
    assert not torch.allclose(score(1, 0), score(0, 1))


def test_half_precision_keeps_its_dtype() -> None:
    x = torch.randn(3, 2, 4, 8, generator=_gen(10)).bfloat16()
    cos, sin = rotary_cos_sin(3, 8, dtype=torch.bfloat16)
    out = rotary_pos_emb_reference(x, cos[:, None, None], sin[:, None, None])
    assert out.dtype == torch.bfloat16
    exact = rotary_pos_emb_reference(x.double(), cos.double()[:, None, None], sin.double()[:, None, None])
    torch.testing.assert_close(out.double(), exact, atol=1e-2, rtol=1e-2)


def test_bad_shapes_are_rejected() -> None:
    x = torch.randn(2, 8)
    cos, sin = rotary_cos_sin(2, 8)
    with pytest.raises(ValueError, match="at most"):
        rotary_pos_emb_reference(x[..., :6], cos, sin)
    with pytest.raises(ValueError, match="one shape"):
        rotary_pos_emb_reference(x, cos, sin[:, :4])
    with pytest.raises(ValueError, match="even"):
        rotary_pos_emb_reference(x, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match="even"):
        rotary_cos_sin(4, 7)


def test_npu_wrapper_slices_reshapes_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The npu wrapper's own logic, with npu_rotary_mul replaced by its documented formula."""
    from mindspeed.ops.backends import npu_basic

    calls: list[tuple[tuple[int, ...], tuple[int, ...], str]] = []

    def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
        assert x.dim() == r1.dim() == 4 and x.dtype == r1.dtype == r2.dtype
        calls.append((tuple(x.shape), tuple(r1.shape), rotary_mode))
        x1, x2 = x.chunk(2, -1) if rotary_mode == "half" else (x[..., ::2], x[..., 1::2])
        rotated = torch.cat((-x2, x1), -1) if rotary_mode == "half" else torch.stack((-x2, x1), -1).flatten(-2)
        return r1 * x + r2 * rotated

    fake = types.SimpleNamespace(npu_rotary_mul=npu_rotary_mul)
    monkeypatch.setattr("mindspeed.ops.backends.npu_basic.import_torch_npu", lambda: fake)
    monkeypatch.setattr(npu_basic, "_rotary_has_interleave", lambda: True)
    x = torch.randn(2, 5, 3, 24, generator=_gen(11))  # [b, s, n, d], 16 of 24 channels rotated
    for interleaved in (False, True):
        cos, sin = rotary_cos_sin(5, 16, interleaved=interleaved)
        for tables in ((cos[:, None], sin[:, None]), (cos.double()[:, None], sin.double()[:, None])):
            out = npu_basic.rotary_pos_emb_npu(x, *tables, interleaved=interleaved)
            torch.testing.assert_close(out, rotary_pos_emb_reference(x, *tables, interleaved=interleaved))
    assert [c[1] for c in calls] == [(1, 5, 1, 16)] * 4 and calls[-1][2] == "interleave"
    calls.clear()
    # Outside the kernel's limits (3-D input, all-broadcast table): the reference, no kernel call.
    cos, sin = rotary_cos_sin(1, 8)
    for args in ((x[0], cos, sin), (x[..., :8], cos, sin)):
        torch.testing.assert_close(npu_basic.rotary_pos_emb_npu(*args), rotary_pos_emb_reference(*args))
    assert calls == []


@pytest.mark.parametrize("interleaved", [False, True])
def test_matches_megatron_partial_rotary(interleaved: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    seq, head_dim, rot_dim = 6, 32, 16
    x = torch.randn(seq, 2, 3, head_dim, generator=_gen(12))
    emb = RotaryEmbedding(
        head_dim, rotary_percent=rot_dim / head_dim, rotary_interleaved=interleaved, use_cpu_initialization=True
    )
    # get_emb moves its frequencies to the current GPU; keep them on the CPU here.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    freqs = emb(seq)  # [s, 1, 1, rot_dim] angles in Megatron's layout for the mode
    expected = rope_utils._apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=interleaved)
    cos, sin = rotary_cos_sin(seq, rot_dim, interleaved=interleaved)
    out = rotary_pos_emb_reference(x, cos[:, None, None], sin[:, None, None], interleaved=interleaved)
    torch.testing.assert_close(out, expected)


def test_native_broadcast_shape_equals_torch() -> None:
    from mindspeed.ops.rotary import _broadcast_shape

    for a, b in [((5, 2, 3, 8), (5, 1, 1, 8)), ((4, 8), (3, 1, 8)), ((1, 7, 1, 4), (6, 1, 2, 4)), ((3,), ())]:
        assert _broadcast_shape(a, b) == tuple(torch.broadcast_shapes(a, b))
    with pytest.raises(ValueError, match="does not broadcast"):
        _broadcast_shape((5, 2, 8), (4, 1, 8))
