"""The attention reference against per-query loops written from each mask's definition."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable

import pytest
import torch

from mindspeed.ops import KERNELS, OPS, KernelImpl
from mindspeed.ops.attention import (
    attach_lse_grad,
    attention_reference,
    attention_sdpa,
    num_empty_rows,
    visible_keys_mask,
)
from mindspeed.ops.backends import cuda_attention, npu_attention
from mindspeed.testing.parity import compare_case

Visible = Callable[[int, int], bool]


def _qkv(batch: int, seq_q: int, seq_k: int, heads_q: int, heads_kv: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, heads_q, dim, generator=gen)
    k = torch.randn(batch, seq_k, heads_kv, dim, generator=gen)
    v = torch.randn(batch, seq_k, heads_kv, dim, generator=gen)
    return q, k, v


def _loop_attention(q, k, v, visible: Visible, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row at a time in float64: keys kept by ``visible(i, j)``, kv head ``h // group``."""
    batch, seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    out = torch.zeros(batch, seq_q, heads_q, dim, dtype=torch.float64)
    lse = torch.full((batch, heads_q, seq_q), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for h in range(heads_q):
            kv_head = h // group
            for i in range(seq_q):
                keys = [j for j in range(seq_k) if visible(i, j)]
                if not keys:
                    continue
                kk = k[b, keys, kv_head].double()
                vv = v[b, keys, kv_head].double()
                row = kk @ q[b, i, h].double() * scale
                lse[b, h, i] = torch.logsumexp(row, dim=0)
                out[b, i, h] = torch.softmax(row, dim=0) @ vv
    return out, lse


def _assert_matches(q, k, v, visible: Visible, scale: float | None = None, **kwargs) -> None:
    out, lse = attention_reference(q, k, v, softmax_scale=scale, return_lse=True, **kwargs)
    expected_out, expected_lse = _loop_attention(q, k, v, visible, scale or 1 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "shape", "kwargs", "visible"),
    [
        ("causal", (2, 7, 7, 4, 4, 8), {}, lambda i, j: j <= i),
        ("full", (1, 6, 9, 3, 3, 8), {"causal": False}, lambda i, j: True),
        ("gqa causal", (1, 9, 9, 6, 2, 8), {}, lambda i, j: j <= i),
        ("mqa full", (2, 5, 5, 4, 1, 8), {"causal": False}, lambda i, j: True),
        # KV-cache decoding: the 3 queries are the last 3 of 10 tokens (absolute positions 7..9).
        ("decode", (1, 3, 10, 4, 2, 8), {}, lambda i, j: j <= 7 + i),
        # More queries than keys: query i is token i - 2, so queries 0 and 1 see nothing.
        ("sq>sk", (1, 6, 4, 2, 2, 8), {}, lambda i, j: j <= i - 2),
        # Mistral sliding window of W = 4 tokens: itself and the 3 before it.
        ("sliding window", (1, 11, 11, 2, 1, 8), {"window_size": (3, 0)}, lambda i, j: i - 4 < j <= i),
        ("band", (1, 10, 10, 2, 2, 8), {"causal": False, "window_size": (2, 3)}, lambda i, j: -2 <= j - i <= 3),
        ("left only", (1, 8, 8, 2, 2, 8), {"causal": False, "window_size": (2, -1)}, lambda i, j: j >= i - 2),
        ("scale", (1, 5, 5, 2, 2, 8), {"softmax_scale": 0.7}, lambda i, j: j <= i),
    ],
)
def test_reference_matches_loop(name: str, shape: tuple, kwargs: dict, visible: Visible) -> None:
    kwargs = dict(kwargs)
    scale = kwargs.pop("softmax_scale", None)
    _assert_matches(*_qkv(*shape), visible, scale=scale, **kwargs)


@pytest.mark.parametrize(
    ("causal", "window_size"), [(True, (-1, -1)), (False, (-1, -1)), (True, (2, 0)), (False, (1, 2))]
)
def test_packed_sequences_equal_separate_runs(causal: bool, window_size: tuple[int, int]) -> None:
    bounds = [0, 4, 4, 9, 12]  # an empty segment too
    q, k, v = _qkv(1, 12, 12, 4, 2, 8)
    out, lse = attention_reference(
        q, k, v, causal=causal, window_size=window_size, cu_seqlens=torch.tensor(bounds), return_lse=True
    )
    for start, end in zip(bounds, bounds[1:]):
        if start == end:
            continue
        part = slice(start, end)
        expected_out, expected_lse = attention_reference(
            q[:, part], k[:, part], v[:, part], causal=causal, window_size=window_size, return_lse=True
        )
        torch.testing.assert_close(out[:, part], expected_out)
        torch.testing.assert_close(lse[:, :, part], expected_lse)


def test_empty_rows_have_zero_output_and_finite_zero_grads() -> None:
    q, k, v = _qkv(1, 6, 4, 4, 2, 8)  # causal, bottom-right: queries 0 and 1 see no key
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = attention_reference(q, k, v, return_lse=True)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    gen = torch.Generator().manual_seed(1)
    cot_out, cot_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    torch.autograd.backward([out, lse], [cot_out, cot_lse])
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :2], torch.zeros_like(q.grad[:, :2]))

    # The other rows and k, v get exactly the gradients of the run without the empty rows.
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q[:, 2:], k, v))
    out2, lse2 = attention_reference(q2, k2, v2, return_lse=True)
    torch.autograd.backward([out2, lse2], [cot_out[:, 2:], cot_lse[:, :, 2:]])
    torch.testing.assert_close(q.grad[:, 2:], q2.grad)
    torch.testing.assert_close(k.grad, k2.grad)
    torch.testing.assert_close(v.grad, v2.grad)


@pytest.mark.parametrize("seq_q", [1, 3, 6, 9])
@pytest.mark.parametrize("seq_k", [1, 4, 6])
@pytest.mark.parametrize(
    ("causal", "window_size"),
    [(True, (-1, -1)), (False, (-1, -1)), (True, (2, 0)), (False, (1, 0)), (False, (0, 2)), (False, (3, -1))],
)
def test_num_empty_rows_matches_mask(seq_q: int, seq_k: int, causal: bool, window_size: tuple[int, int]) -> None:
    mask = visible_keys_mask(seq_q, seq_k, causal=causal, window_size=window_size)
    empty = torch.zeros(seq_q, dtype=torch.bool) if mask is None else ~mask.any(dim=-1)
    count = num_empty_rows(seq_q, seq_k, causal=causal, window_size=window_size)
    assert empty.sum().item() == count
    assert empty[:count].all()  # and they are the leading rows


@pytest.mark.parametrize(
    ("seq_q", "kwargs"),
    [
        (9, {}),
        (12, {}),  # 3 rows without keys
        (5, {"causal": False}),
        (12, {"window_size": (2, 0)}),
        (9, {"causal": False, "window_size": (1, 2), "cu_seqlens": torch.tensor([0, 5, 9])}),
    ],
)
def test_attach_lse_grad_gives_the_reference_lse_gradient(seq_q: int, kwargs: dict) -> None:
    """What the flash-attn and NPU backends use to differentiate their lse, driven here by SDPA."""
    q, k, v = _qkv(1, seq_q, 9, 4, 2, 8, seed=3)
    scale = 0.4
    cot = torch.randn(1, 4, seq_q, generator=torch.Generator().manual_seed(2))

    q1, k1 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    _, lse = attention_reference(q1, k1, v, softmax_scale=scale, return_lse=True, **kwargs)
    lse.backward(cot)

    def attend(q_, k_, v_):
        return attention_sdpa(q_, k_, v_, softmax_scale=scale, **kwargs)

    q2, k2 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    attached = attach_lse_grad(lse.detach(), q2, k2, attend, scale)
    attached.backward(cot)
    torch.testing.assert_close(q2.grad, q1.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k2.grad, k1.grad, atol=1e-5, rtol=1e-5)


def test_bf16_output_dtype_and_fp32_lse() -> None:
    q, k, v = (t.bfloat16() for t in _qkv(1, 5, 5, 2, 2, 8))
    out, lse = attention_reference(q, k, v, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (1, 2, 5)


@pytest.mark.parametrize(
    ("shapes", "kwargs", "message"),
    [
        (((1, 4, 3, 8), (1, 4, 2, 8)), {}, "multiple of kv heads"),
        (((2, 4, 2, 8), (2, 4, 2, 8)), {"cu_seqlens": torch.tensor([0, 4])}, "batch == 1"),
        (((1, 4, 2, 8), (1, 4, 2, 8)), {"cu_seqlens": torch.tensor([0, 3])}, "rise from 0"),
        (((1, 4, 2, 8), (1, 4, 2, 8)), {"window_size": (-2, 0)}, "window_size"),
    ],
)
def test_bad_inputs_raise(shapes: tuple, kwargs: dict, message: str) -> None:
    q, k = torch.randn(shapes[0]), torch.randn(shapes[1])
    with pytest.raises(ValueError, match=message):
        attention_reference(q, k, k, **kwargs)


@pytest.mark.slow  # importing transformers' Llama takes ~10 s on a 2-core machine
def test_matches_transformers_eager_gqa() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k, v = _qkv(2, 7, 7, 6, 2, 8)
    seq = q.shape[1]
    additive = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    expected, _ = llama.eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), additive, scaling=8**-0.5
    )
    torch.testing.assert_close(attention_reference(q, k, v), expected)


# -- vendor backends against emulators of their documented APIs -----------------------------
# flash-attn and torch_npu are absent here. These stand-ins follow the vendors' documented
# contracts, quirks included (flash-attn: lse +inf on rows without keys and no lse gradient;
# npu_fusion_attention: sparse modes, the compressed mask, [.., 8] max/sum statistics, TND),
# so the backends' plumbing is proven on CPU: argument conventions, lse shapes and units, rows
# without keys and the lse gradient that the kernels drop.


def _fake_flash_attn() -> types.ModuleType:
    def flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes=None, return_attn_probs=False
    ):
        assert dropout_p == 0.0 and (not causal or window_size[1] == 0)
        assert alibi_slopes is None or alibi_slopes.dtype == torch.float32
        out, lse = attention_reference(
            q,
            k,
            v,
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            return_lse=True,
            alibi_slopes=alibi_slopes,
        )
        lse = lse.detach().masked_fill(torch.isneginf(lse), float("inf"))
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes=None,
        return_attn_probs=False,
    ):
        assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
        assert max_seqlen_q == max_seqlen_k == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        out, lse = attention_reference(
            q[None],
            k[None],
            v[None],
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            cu_seqlens=cu_seqlens_q,
            return_lse=True,
            alibi_slopes=alibi_slopes,
        )
        return (out[0], lse[0].detach(), None) if return_attn_probs else out[0]  # lse: (heads, total)

    module = types.ModuleType("flash_attn")
    module.flash_attn_func, module.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return module


def _fake_torch_npu() -> types.ModuleType:
    def npu_fusion_attention(
        query,
        key,
        value,
        head_num,
        input_layout,
        *,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=2147483647,
        inner_precise=0,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
    ):
        assert keep_prob == 1.0 and head_num == query.shape[-2]
        packed = input_layout == "TND"
        cu_seqlens = None
        if packed:
            assert actual_seq_qlen == actual_seq_kvlen and query.dim() == 3
            cu_seqlens = torch.tensor([0, *actual_seq_qlen])
            query, key, value = query[None], key[None], value[None]
        else:
            assert input_layout == "BSND" and actual_seq_qlen is None
        if sparse_mode == 0:
            assert atten_mask is None
            causal, window = False, (-1, -1)
        else:
            assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
            assert sparse_mode in (3, 4)
            # 3: causal from the bottom-right corner; 4: band [pos - pre, pos + next], same anchor.
            causal, window = (True, (-1, -1)) if sparse_mode == 3 else (False, (pre_tockens, next_tockens))
        out, lse = attention_reference(
            query,
            key,
            value,
            causal=causal,
            softmax_scale=scale,
            window_size=window,
            cu_seqlens=cu_seqlens,
            return_lse=True,
        )
        lse = lse.detach()
        # Any (max, sum) with max + log(sum) = lse; rows without keys get arbitrary finite values.
        row_max = torch.where(torch.isfinite(lse), lse - 0.75, torch.finfo(torch.float32).min)
        row_sum = torch.where(torch.isfinite(lse), math.exp(0.75), 1.0)
        if packed:
            out, row_max, row_sum = out[0], row_max[0].transpose(0, 1), row_sum[0].transpose(0, 1)
        eight = lambda t: t[..., None].expand(*t.shape, 8).contiguous()  # noqa: E731
        return out, eight(row_max), eight(row_sum), torch.empty(0), 0, 0, 0

    module = types.ModuleType("torch_npu")
    module.npu_fusion_attention = npu_fusion_attention
    return module


# (Not named "npu": pytest's keywords include parameter ids, and the conftest skips "npu" items.)
@pytest.mark.parametrize("backend", ["flash_attn", "torch_npu"])
def test_vendor_backend_against_emulated_vendor_api(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "flash_attn":
        monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
        impl = KernelImpl(op="attention", name=backend, fn=cuda_attention.flash_attention)
    else:
        monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
        impl = KernelImpl(op="attention", name=backend, fn=npu_attention.attention_npu)
    spec, reference = OPS.get("attention"), KERNELS.get(("attention", "reference"))
    registered = KERNELS.get(("attention", "flash_attn" if backend == "flash_attn" else "npu"))
    problems = []
    for case in spec.cases(torch.float32, torch.device("cpu")):
        if registered.supports(case.features):  # the NPU backend has no ALiBi yet
            problems += compare_case(spec, impl, reference, case, torch.float32)
    assert not problems, "\n".join(problems)
