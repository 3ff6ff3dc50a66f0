"""grouped_matmul's reference against independent computations: a per-token loop, closed-form
gradients, and megatron-core's SequentialMLP (the per-expert module GroupedMLP replaces)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from mindspeed.ops import KERNELS
from mindspeed.ops import grouped_matmul as gm
from mindspeed.ops.grouped_matmul import grouped_matmul_native, grouped_matmul_reference


def _inputs(counts: list[int], in_features: int, out_features: int, dtype: torch.dtype = torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), in_features, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(len(counts), in_features, out_features, generator=gen, dtype=torch.float64).to(dtype)
    return x, weight, torch.tensor(counts, dtype=torch.int64)


def _expert_of_row(counts: list[int]) -> list[int]:
    return [e for e, n in enumerate(counts) for _ in range(n)]


def _per_token(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Row by row: y[t] = x[t] @ weight[expert of t]."""
    rows = [x[t : t + 1] @ weight[e] for t, e in enumerate(_expert_of_row(counts))]
    return torch.cat(rows) if rows else x.new_zeros(0, weight.shape[2])


SHAPES = [
    ([7, 12, 3, 10], 64, 32),
    ([0, 9, 0, 0, 17, 0], 32, 48),  # experts without tokens, first and last included
    ([5, 1, 13], 33, 17),  # odd feature sizes
    ([11], 16, 24),  # a single expert
    ([0, 0, 0], 8, 8),  # no tokens at all
]


@pytest.mark.parametrize(("counts", "in_features", "out_features"), SHAPES)
def test_reference_equals_per_token_loop(counts, in_features, out_features) -> None:
    x, weight, tokens = _inputs(counts, in_features, out_features)
    torch.testing.assert_close(grouped_matmul_reference(x, weight, tokens), _per_token(x, weight, counts))


def test_reference_in_bf16_is_a_plain_bf16_matmul() -> None:
    # Documented numerics: no up-cast, i.e. what torch.matmul gives in the input dtype.
    counts = [40, 0, 25, 63]
    x, weight, tokens = _inputs(counts, 64, 48, dtype=torch.bfloat16)
    actual = grouped_matmul_reference(x, weight, tokens)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual, _per_token(x, weight, counts), atol=0.0, rtol=2e-2)
    exact = _per_token(x.double(), weight.double(), counts)
    torch.testing.assert_close(actual.double(), exact, atol=0.1, rtol=2e-2)


@pytest.mark.parametrize(("counts", "in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("impl", ["reference", "native"])
def test_gradients_match_closed_form(impl, counts, in_features, out_features) -> None:
    x, weight, tokens = _inputs(counts, in_features, out_features)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    y = KERNELS.get(("grouped_matmul", impl))(x, weight, tokens)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    y.backward(grad_y)
    # dx[t] = dy[t] @ W[e(t)]^T ; dW[e] = sum over e's rows of outer(x[t], dy[t]).
    one_hot = F.one_hot(torch.tensor(_expert_of_row(counts), dtype=torch.int64), len(counts)).to(x.dtype)
    expected_dx = torch.einsum("to,te,eio->ti", grad_y, one_hot, weight.detach())
    expected_dw = torch.einsum("te,ti,to->eio", one_hot, x.detach(), grad_y)
    torch.testing.assert_close(x.grad, expected_dx)
    torch.testing.assert_close(weight.grad, expected_dw)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(weight.grad[e]) == 0, f"expert {e} has no tokens but a gradient"


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_sum_loss_backward(impl) -> None:
    # out.sum().backward() hands a stride-0 gradient to the op's backward (torch._grouped_mm's
    # own derivative rejects it); the gradients must still be right.
    counts = [6, 0, 10, 16]
    x, weight, tokens = _inputs(counts, 48, 64, dtype=torch.float32)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    KERNELS.get(("grouped_matmul", impl))(x, weight, tokens).sum().backward()
    one_hot = F.one_hot(torch.tensor(_expert_of_row(counts)), len(counts)).float()
    # With dy = 1: dx[t] = row sums of W[e(t)]; dW[e][i, :] = sum of x[t, i] over e's rows.
    torch.testing.assert_close(x.grad, one_hot @ weight.detach().sum(dim=2))
    torch.testing.assert_close(weight.grad, (one_hot.t() @ x.detach()).unsqueeze(2).expand(-1, -1, 64))


def test_native_runs_torch_grouped_mm_where_it_probes_ok(monkeypatch) -> None:
    # The "native" kernel must really use torch._grouped_mm where the probe passes (here: the CPU
    # fallback kernel of torch), not silently the loop, and agree with the reference.
    if not gm._probe_grouped_mm(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm does not work on this CPU build")
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, weight, tokens = _inputs([6, 0, 10, 4], 48, 64, dtype=torch.float32)
    torch.testing.assert_close(grouped_matmul_native(x, weight, tokens), grouped_matmul_reference(x, weight, tokens))
    assert calls, "aligned fp32 inputs did not reach torch._grouped_mm"
    calls.clear()
    x, weight, tokens = _inputs([5, 1, 13], 33, 17, dtype=torch.float32)  # unaligned: the loop
    torch.testing.assert_close(grouped_matmul_native(x, weight, tokens), grouped_matmul_reference(x, weight, tokens))
    assert not calls


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_bad_arguments_raise(impl) -> None:
    fn = KERNELS.get(("grouped_matmul", impl))
    x, weight, _ = _inputs([3, 4], 8, 6)
    with pytest.raises(ValueError, match="sum to the 7 rows"):
        fn(x, weight, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="one per expert"):
        fn(x, weight, torch.tensor([7]))
    with pytest.raises(ValueError, match="input features"):
        fn(x, weight.transpose(1, 2), torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="cast one of them"):
        fn(x.float(), weight, torch.tensor([3, 4]))


# -- megatron-core's SequentialMLP ---------------------------------------------------------------


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-rank gloo group: megatron's parallel linears need a real (size-1) process group."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_grouped_mlp_equals_megatron_sequential_mlp(single_rank_group) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns that TransformerEngine and Apex are absent
        experts_mod = pytest.importorskip("megatron.core.transformer.moe.experts")
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.transformer_config import TransformerConfig

    hidden, ffn, counts = 16, 24, [5, 0, 9, 3]
    num_experts = len(counts)
    group = single_rank_group
    pg = types.SimpleNamespace(ep=group, expt_tp=group, expt_dp=group, tp=group)
    with torch.random.fork_rng(), warnings.catch_warnings():  # megatron initialises from the global RNG
        warnings.simplefilter("ignore")  # and warns about config defaults irrelevant here
        config = TransformerConfig(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=1,
            ffn_hidden_size=ffn,
            moe_ffn_hidden_size=ffn,
            num_moe_experts=num_experts,
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            bias_activation_fusion=False,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
        )
        torch.manual_seed(0)
        mlp = experts_mod.SequentialMLP(
            num_experts,
            config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            pg_collection=pg,
        )
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), hidden, generator=gen)
    probs = torch.rand(sum(counts), generator=gen)
    tokens = torch.tensor(counts)
    grad_out = torch.randn(sum(counts), hidden, generator=gen)

    expected, _ = mlp(x, tokens, probs)
    expected.backward(grad_out)

    # GroupedMLP's computation: gmm, SwiGLU scaled by the routing prob, gmm. Megatron's linear
    # weights are [out, in]; grouped_matmul wants [experts, in, out].
    w1 = torch.stack([e.linear_fc1.weight.detach().t() for e in mlp.local_experts]).requires_grad_(True)
    w2 = torch.stack([e.linear_fc2.weight.detach().t() for e in mlp.local_experts]).requires_grad_(True)
    gate, up = torch.chunk(grouped_matmul_reference(x, w1, tokens), 2, dim=-1)
    actual = grouped_matmul_reference(F.silu(gate) * up * probs.unsqueeze(-1), w2, tokens)
    actual.backward(grad_out)

    torch.testing.assert_close(actual, expected)
    for e, expert in enumerate(mlp.local_experts):
        torch.testing.assert_close(w1.grad[e].t(), expert.linear_fc1.weight.grad)
        torch.testing.assert_close(w2.grad[e].t(), expert.linear_fc2.weight.grad)
