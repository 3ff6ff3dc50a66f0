"""moe_permute / moe_unpermute against megatron-core's own moe_utils.permute / unpermute
(forward and gradients) and against closed forms of the round trip."""

from __future__ import annotations

import warnings

import pytest
import torch

from mindspeed.ops import KERNELS
from mindspeed.ops.moe_permute import moe_permute_reference, moe_unpermute_reference, topk_routing_map

IMPLS = ["reference", "native"]


@pytest.fixture(scope="module")
def megatron_moe_utils():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns that TransformerEngine and Apex are absent
        return pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _routing(num_tokens: int, num_experts: int, topk: int, drop: bool, seed: int) -> torch.Tensor:
    return topk_routing_map(num_tokens, num_experts, topk, torch.Generator().manual_seed(seed), drop)


ROUTINGS = [  # (tokens, hidden, experts, topk, drop)
    (16, 32, 8, 2, False),
    (13, 7, 5, 1, False),
    (23, 24, 6, 3, True),  # some tokens routed nowhere, some to fewer than topk experts
    (9, 16, 1, 1, False),
    (5, 3, 7, 7, False),  # every token to every expert
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("num_tokens", "hidden", "num_experts", "topk", "drop"), ROUTINGS)
def test_permute_matches_megatron(megatron_moe_utils, impl, num_tokens, hidden, num_experts, topk, drop) -> None:
    routing_map = _routing(num_tokens, num_experts, topk, drop, seed=num_tokens)
    tokens = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3))
    ours_in, theirs_in = tokens.clone().requires_grad_(True), tokens.clone().requires_grad_(True)

    permuted, sorted_indices = KERNELS.get(("moe_permute", impl))(ours_in, routing_map)
    expected, _, expected_indices = megatron_moe_utils.permute(theirs_in, routing_map)

    assert sorted_indices.dtype == torch.int64
    assert torch.equal(sorted_indices, expected_indices)
    assert torch.equal(permuted, expected)
    grad = torch.randn(permuted.shape, generator=torch.Generator().manual_seed(4))
    permuted.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("num_tokens", "hidden", "num_experts", "topk", "drop"), ROUTINGS)
@pytest.mark.parametrize("probs_kind", ["same dtype", "fp32 probs", "none"])
def test_unpermute_matches_megatron(
    megatron_moe_utils, impl, num_tokens, hidden, num_experts, topk, drop, probs_kind
) -> None:
    dtype = torch.bfloat16 if probs_kind == "fp32 probs" else torch.float32  # bf16 rows, fp32 router
    gen = torch.Generator().manual_seed(5)
    routing_map = _routing(num_tokens, num_experts, topk, drop, seed=num_tokens + 1)
    _, sorted_indices = moe_permute_reference(torch.zeros(num_tokens, 1), routing_map)
    permuted = torch.randn(sorted_indices.numel(), hidden, generator=gen).to(dtype)
    probs = None if probs_kind == "none" else torch.rand(num_tokens, num_experts, generator=gen)
    if probs is not None and probs_kind == "same dtype":
        probs = probs.to(dtype)
    shape = torch.Size((num_tokens, hidden))

    def run(fn):
        rows = permuted.clone().requires_grad_(True)
        weights = None if probs is None else probs.clone().requires_grad_(True)
        out = fn(rows, sorted_indices, shape, probs=weights, routing_map=None if probs is None else routing_map)
        out.float().mul(torch.randn(out.shape, generator=torch.Generator().manual_seed(6))).sum().backward()
        return out, rows.grad, None if weights is None else weights.grad

    ours = run(KERNELS.get(("moe_unpermute", impl)))
    theirs = run(megatron_moe_utils.unpermute)
    assert ours[0].dtype == dtype
    for actual, expected in zip(ours, theirs):
        if expected is None:
            assert actual is None
        else:
            torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("topk", [1, 2])
def test_round_trip_with_probs_is_prob_weighted_sum(impl, topk) -> None:
    num_tokens, hidden, num_experts = 19, 11, 6
    gen = torch.Generator().manual_seed(7)
    routing_map = _routing(num_tokens, num_experts, topk, drop=True, seed=8)
    tokens = torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64).requires_grad_(True)
    probs = torch.rand(num_tokens, num_experts, generator=gen, dtype=torch.float64).requires_grad_(True)
    permuted, sorted_indices = KERNELS.get(("moe_permute", impl))(tokens, routing_map)
    out = KERNELS.get(("moe_unpermute", impl))(permuted, sorted_indices, tokens.shape, probs, routing_map)

    # Closed form: out[t] = sum over routed experts e of probs[t, e] * tokens[t].
    weight = (probs * routing_map).sum(dim=1, keepdim=True)
    torch.testing.assert_close(out, weight * tokens)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad)
    torch.testing.assert_close(tokens.grad, weight.detach() * grad)
    # d out / d probs[t, e] = <grad[t], tokens[t]> where routed, 0 elsewhere.
    expected_probs_grad = (grad * tokens.detach()).sum(dim=1, keepdim=True) * routing_map
    torch.testing.assert_close(probs.grad, expected_probs_grad)


@pytest.mark.parametrize("impl", IMPLS)
def test_round_trip_without_probs_counts_experts_and_zeroes_unrouted(impl) -> None:
    routing_map = _routing(17, 5, 2, drop=True, seed=9)
    tokens = torch.randn(17, 6, generator=torch.Generator().manual_seed(10))
    permuted, sorted_indices = KERNELS.get(("moe_permute", impl))(tokens, routing_map, routing_map.sum().item())
    out = KERNELS.get(("moe_unpermute", impl))(permuted, sorted_indices, tokens.shape)
    counts = routing_map.sum(dim=1, keepdim=True)
    assert (counts == 0).any() and (counts == 1).any() and (counts == 2).any()  # the map covers all cases
    torch.testing.assert_close(out, counts * tokens)
    assert torch.count_nonzero(out[counts.squeeze(1) == 0]) == 0


def test_permuted_rows_are_expert_major_in_token_order() -> None:
    routing_map = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    tokens = torch.arange(4.0).unsqueeze(1).expand(4, 2)
    permuted, sorted_indices = moe_permute_reference(tokens, routing_map)
    # expert 0: tokens 0, 2; expert 1: tokens 2, 3; expert 2: tokens 0, 3 (token 1 goes nowhere)
    assert sorted_indices.tolist() == [0, 2, 2, 3, 0, 3]
    assert permuted[:, 0].tolist() == [0.0, 2.0, 2.0, 3.0, 0.0, 3.0]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise(impl) -> None:
    permute, unpermute = KERNELS.get(("moe_permute", impl)), KERNELS.get(("moe_unpermute", impl))
    routing_map = _routing(6, 4, 2, drop=False, seed=11)
    tokens = torch.randn(6, 3)
    with pytest.raises(ValueError, match="num_out_tokens=5"):
        permute(tokens, routing_map, num_out_tokens=5)
    with pytest.raises(ValueError, match="routing_map"):
        permute(tokens[:5], routing_map)
    permuted, sorted_indices = moe_permute_reference(tokens, routing_map)
    with pytest.raises(ValueError, match="need the routing_map"):
        unpermute(permuted, sorted_indices, tokens.shape, torch.rand(6, 4))
    with pytest.raises(ValueError, match="restore_shape"):
        unpermute(permuted, sorted_indices, (6, 4))
    assert moe_unpermute_reference(permuted, sorted_indices, tokens.shape).shape == tokens.shape
