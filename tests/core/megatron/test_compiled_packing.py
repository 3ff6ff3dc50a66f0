"""The packed attention op of compiled layers (``mindspeed.megatron.compiled_packing``) against the eager attention.

``packed_attention_saved`` keeps the pullback of its forward for the backward: its outputs and its
query, key and value gradients must equal the eager per-segment attention's autograd exactly (the
same kernels run), eagerly and inside an Inductor graph (AOT autograd moves the handle from the
forward to the backward graph), for plain THD packing and for shared-prefix groups; the backward
must not run the attention forward again; a pullback dropped at the next microbatch falls back to
recomputing (same numbers). The model-level numbers are in ``tests/rl/models/test_actor_compile.py``.
"""

from __future__ import annotations

import pytest
import torch

HEADS, KV_HEADS, DIM = 4, 2, 8


def _params(kind: str):
    from megatron.core.packed_seq_params import PackedSeqParams

    from mindspeed.megatron.shared_prefix import shared_prefix_params

    if kind == "shared":
        return shared_prefix_params([(4, (3, 5, 1)), (2, (2,)), (6, (4, 4))])
    cu = torch.tensor([0, 5, 12, 20, 23], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(tokens, HEADS, DIM), (tokens, KV_HEADS, DIM), (tokens, KV_HEADS, DIM), (tokens, HEADS, DIM)]
    return tuple(torch.randn(*shape, generator=gen) for shape in shapes)


def _grads(fn, q, k, v, cotangent) -> tuple[torch.Tensor, ...]:
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(cotangent)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind", ["plain", "shared"])
def test_saved_pullback_backward_equals_eager_attention(kind: str, monkeypatch) -> None:
    import mindspeed.megatron.compiled_packing as packing

    params = _params(kind)
    tokens = int(params.cu_seqlens_q[-1])
    q, k, v, cotangent = _inputs(tokens, seed=1)
    scale = DIM**-0.5
    monkeypatch.setattr(packing, "_current", [params])
    monkeypatch.setattr(packing, "_saved", {})
    calls = []
    attend = packing._attend_segments

    def counted(*args):
        calls.append(1)
        return attend(*args)

    def saved_op(q, k, v):
        return packing.packed_attention_saved(q, k, v, scale, "auto")[0]

    want = _grads(lambda q, k, v: attend(q, k, v, scale, "auto"), q, k, v, cotangent)
    monkeypatch.setattr(packing, "_attend_segments", counted)
    eager = _grads(saved_op, q, k, v, cotangent)
    assert len(calls) == 1, "the backward ran the attention forward again"
    compiled = _grads(torch.compile(saved_op, backend="inductor", fullgraph=True, dynamic=False), q, k, v, cotangent)
    assert len(calls) == 2, "the compiled backward ran the attention forward again"
    for got in (eager, compiled):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"{kind} {name}: {(a - b).abs().max():.3e}"
    assert packing._saved == {}, "a pullback outlived its backward"
    # The forward alone equals the op that saves nothing (the no-grad path).
    assert torch.equal(packing.packed_attention(q, k, v, scale, "auto"), want[0])

    # A pullback dropped (the next microbatch started) is recomputed from q, k, v: the same numbers.
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = saved_op(qg, kg, vg)
    assert len(packing._saved) == 1
    packing._saved.clear()
    out.backward(cotangent)
    for name, a, b in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), want[1:]):
        assert torch.equal(a, b), f"{kind} recomputed {name}: {(a - b).abs().max():.3e}"


def test_new_microbatch_drops_pullbacks_left_without_backward(monkeypatch) -> None:
    import mindspeed.megatron.compiled_packing as packing

    monkeypatch.setattr(packing, "_current", [None])
    monkeypatch.setattr(packing, "_last", [None, None, None, None])
    monkeypatch.setattr(packing, "_saved", {7: object()})
    first, second = _params("plain"), _params("plain")
    hidden = torch.zeros(23, 1, 4)
    packing.compiled_layer_inputs({"hidden_states": hidden, "packed_seq_params": first})
    assert packing._saved == {}
    packing._saved[8] = object()
    packing.compiled_layer_inputs({"hidden_states": hidden, "packed_seq_params": first})  # next layer, same microbatch
    assert list(packing._saved) == [8]
    packing.compiled_layer_inputs({"hidden_states": hidden, "packed_seq_params": second})
    assert packing._saved == {}
