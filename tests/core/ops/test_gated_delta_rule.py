"""gated_delta_rule: the chunked form equals the token-by-token recurrence (forward and backward),
both equal transformers' Qwen3-Next torch fallbacks, and a state carried between calls equals one call."""

from __future__ import annotations

import pytest
import torch

from mindspeed.ops import available_kernels, resolve_kernel
from mindspeed.ops.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    make_gated_delta_rule_inputs,
)

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _run(fn, inputs: tuple[torch.Tensor, ...], cotangent_seed: int = 7, **kwargs) -> dict[str, torch.Tensor]:
    """Output, final state and the gradients of every input for a fixed random projection of both."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    q, k, v, g, beta, h0 = leaves
    out, state = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)
    # The same fp64 cotangents for every implementation and dtype, on the outputs' device.
    gen = torch.Generator().manual_seed(cotangent_seed)
    loss = (out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device)).sum()
    loss = loss + (state.double() * torch.randn(state.shape, generator=gen, dtype=torch.float64).to(out.device)).sum()
    loss.backward()
    result = {"out": out.detach(), "state": state.detach()}
    result.update({f"grad {name}": leaf.grad for name, leaf in zip(NAMES, leaves)})
    return result


def _unwrapped(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _assert_all_close(actual: dict, expected: dict, atol: float, rtol: float, what: str) -> None:
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], atol=atol, rtol=rtol, msg=lambda m: f"{what}, {key}: {m}"
        )


@pytest.mark.parametrize(
    ("dtype", "l2norm", "tol"),
    [(torch.float64, False, 1e-10), (torch.float64, True, 1e-10), (torch.float32, True, 2e-5)],
    ids=["fp64", "fp64-l2norm", "fp32-l2norm"],
)
def test_chunked_equals_recurrent_forward_and_backward(dtype: torch.dtype, l2norm: bool, tol: float) -> None:
    # 37 tokens: chunk sizes that divide nothing (5, 16), one longer than the sequence (64), and 1.
    inputs = make_gated_delta_rule_inputs(2, 37, 3, 8, 6, dtype=dtype, seed=3, with_state=True)
    if not l2norm:  # keep k.k * beta < 2 so the recurrence stays contractive (as l2-normalised keys are)
        inputs = (inputs[0], inputs[1] / inputs[1].shape[-1] ** 0.5, *inputs[2:])
    expected = _run(gated_delta_rule_recurrent, inputs, use_qk_l2norm_in_kernel=l2norm)
    for chunk_size in (1, 5, 16, 64):
        actual = _run(gated_delta_rule_chunked, inputs, use_qk_l2norm_in_kernel=l2norm, chunk_size=chunk_size)
        _assert_all_close(actual, expected, tol, tol, f"chunk_size {chunk_size}")
    assert expected["grad g"].abs().max() > 1e-3 and expected["grad initial_state"].abs().max() > 1e-3


def test_equals_transformers_qwen3_next_fallbacks() -> None:
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    inputs = make_gated_delta_rule_inputs(2, 70, 3, 16, 8, seed=1, with_state=True)

    # transformers wraps its torch functions so that they call FLA where it is installed: unwrap
    # them to compare with the torch code itself on any host.
    torch_chunk, torch_recurrent = (
        _unwrapped(f) for f in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule)
    )
    assert torch_chunk.__module__ == hf.__name__ and torch_recurrent.__module__ == hf.__name__

    def hf_chunk(q, k, v, g, beta, **kw):
        return torch_chunk(q, k, v, g, beta, chunk_size=64, **kw)

    def hf_recurrent(q, k, v, g, beta, **kw):
        return torch_recurrent(q, k, v, g, beta, **kw)

    for l2norm in (True, False):
        ours = {
            "chunked": _run(gated_delta_rule_chunked, inputs, use_qk_l2norm_in_kernel=l2norm),
            "recurrent": _run(gated_delta_rule_recurrent, inputs, use_qk_l2norm_in_kernel=l2norm),
        }
        theirs = {
            "chunk": _run(hf_chunk, inputs, use_qk_l2norm_in_kernel=l2norm),
            "recurrent": _run(hf_recurrent, inputs, use_qk_l2norm_in_kernel=l2norm),
        }
        # Unnormalised keys (|k|^2 ~ 16) make the recurrence expansive and the values large:
        # the comparison is relative there.
        atol = 1e-5 if l2norm else 1e-3
        for our_name, our in ours.items():
            for their_name, their in theirs.items():
                _assert_all_close(our, their, atol, 1e-5, f"ours {our_name} vs transformers {their_name}, l2={l2norm}")


def test_state_carried_across_two_calls_equals_one_call() -> None:
    q, k, v, g, beta, h0 = make_gated_delta_rule_inputs(1, 45, 2, 8, 8, seed=5, with_state=True)
    kw = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
    full_out, full_state = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, chunk_size=16, **kw)
    # A prefill of 29 tokens (not a chunk multiple), then a chunked continuation and 1-token recurrent steps.
    cut = 29
    first_out, state = gated_delta_rule_chunked(
        q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state=h0, chunk_size=16, **kw
    )
    rest = slice(cut, None)
    second_out, second_state = gated_delta_rule_chunked(
        q[:, rest], k[:, rest], v[:, rest], g[:, rest], beta[:, rest], initial_state=state, chunk_size=16, **kw
    )
    torch.testing.assert_close(torch.cat([first_out, second_out], dim=1), full_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second_state, full_state, atol=1e-5, rtol=1e-5)
    steps = []
    for t in range(cut, q.shape[1]):
        step = slice(t, t + 1)
        out, state = gated_delta_rule_recurrent(
            q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], initial_state=state, **kw
        )
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), full_out[:, cut:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, full_state, atol=1e-5, rtol=1e-5)


def test_dtypes_and_no_final_state() -> None:
    q, k, v, g, beta = make_gated_delta_rule_inputs(1, 9, 2, 8, 4, dtype=torch.bfloat16, seed=2)
    out, state = gated_delta_rule_chunked(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16 and state is None
    _, state = gated_delta_rule_chunked(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert state.dtype == torch.float32 and state.shape == (1, 2, 8, 4)


def test_bad_shapes_name_the_argument() -> None:
    q, k, v, g, beta, h0 = make_gated_delta_rule_inputs(1, 4, 2, 8, 4, seed=0, with_state=True)
    with pytest.raises(ValueError, match="v .* must be \\[batch, seq, heads, v_dim\\]"):
        gated_delta_rule_chunked(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="beta"):
        gated_delta_rule_recurrent(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0.transpose(-1, -2))
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=0)


def test_registry_choices_on_this_host() -> None:
    assert resolve_kernel("gated_delta_rule", "reference", device="cpu").name == "reference"
    assert resolve_kernel("gated_delta_rule", "recurrent", device="cpu").fn is gated_delta_rule_recurrent
    # The recurrent form never wins "auto"; FLA registers for CUDA only.
    assert resolve_kernel("gated_delta_rule", "auto", device="cpu").name == "reference"
    assert "fla" not in [impl.name for impl in available_kernels("gated_delta_rule", "cpu")]
    with pytest.raises(ValueError, match="runs on cuda"):
        resolve_kernel("gated_delta_rule", "fla", device="cpu")


@pytest.mark.gpu
def test_fla_backend_matches_reference_on_cuda() -> None:
    pytest.importorskip("fla.ops.gated_delta_rule")
    impl = resolve_kernel("gated_delta_rule", "auto", device="cuda")
    assert impl.name == "fla"
    inputs = make_gated_delta_rule_inputs(2, 200, 4, 64, 64, dtype=torch.float32, seed=4, with_state=True)
    expected = _run(gated_delta_rule_chunked, [t.cuda() for t in inputs], use_qk_l2norm_in_kernel=True)
    bf16 = [t.cuda().to(torch.bfloat16) for t in inputs[:5]] + [inputs[5].cuda()]
    actual = _run(impl.fn, bf16, use_qk_l2norm_in_kernel=True)
    for key in expected:
        err = (actual[key].float() - expected[key].float()).abs().max() / expected[key].abs().max()
        assert err < 3e-2, f"fla vs reference, {key}: relative error {err:.2e}"
