"""The gated delta rule: the linear-attention recurrence of Gated DeltaNet (Qwen3-Next's linear layers).

Per batch row and head, a state ``S`` (``[K, V]``) is carried along the sequence; token ``t`` with
query ``q_t``, key ``k_t`` (``[K]``), value ``v_t`` (``[V]``), log decay ``g_t <= 0`` and write
strength ``beta_t`` in ``(0, 1)`` does::

    S   = exp(g_t) * S                              # decay (the "gate")
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T        # delta rule: move S^T k_t towards v_t
    o_t = S^T (scale * q_t)                          # scale defaults to K ** -0.5

Two references compute it:

- :func:`gated_delta_rule_recurrent`: the recurrence above, token by token (what a decode step
  with a cached state needs);
- :func:`gated_delta_rule_chunked` (the op's reference): the same in chunks of ``chunk_size``
  tokens. Inside a chunk the corrections ``w_i = beta_i (v_i - S_{i-}^T k_i)`` of all tokens
  satisfy one unit lower-triangular system ``(I + A) W = beta V - diag(beta Gamma) K S_0`` with
  ``A_ij = beta_i (Gamma_i / Gamma_j) k_i . k_j`` (``j < i``) and ``Gamma_i`` the decay from the
  chunk's start through token ``i`` (the WY / UT transform); solving it makes the chunk a few
  matmuls, and only the chunk-to-chunk state update is sequential.

Both take and return FLA's and transformers' layout: ``q, k`` ``[B, T, H, K]``, ``v``
``[B, T, H, V]``, ``g, beta`` ``[B, T, H]``, the state ``[B, H, K, V]``; they compute in fp32
(fp64 for fp64 inputs), return the output in ``q.dtype`` and the final state in the compute
dtype. Backward is autograd through either form. ``use_qk_l2norm_in_kernel`` normalises ``q``
and ``k`` as FLA does: ``x / sqrt(sum(x^2) + 1e-6)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mindspeed.ops.registry import Case, OpSpec, Tolerance, register_kernel, register_op

#: FLA's and transformers' chunk length.
DEFAULT_CHUNK_SIZE = 64
#: The epsilon of FLA's ``l2norm`` (inside the square root).
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (FLA's definition, eps inside the root).

    Computed in fp32 (fp64 for fp64 inputs) and returned in ``x.dtype``, as FLA's ``l2norm``.
    """
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * torch.rsqrt(x32.pow(2).sum(dim=-1, keepdim=True) + eps)).to(x.dtype)


def check_gated_delta_rule_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> None:
    """Raise a ``ValueError`` naming the argument whose shape does not fit the others."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"gated_delta_rule: q {list(q.shape)} and k {list(k.shape)} must both be [batch, seq, heads, k_dim]"
        )
    batch, seq, heads, k_dim = q.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (batch, seq, heads):
        raise ValueError(
            f"gated_delta_rule: v {list(v.shape)} must be [batch, seq, heads, v_dim] with q's {[batch, seq, heads]} "
            "(repeat q and k per value head first when there are fewer key heads)"
        )
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (batch, seq, heads):
            raise ValueError(
                f"gated_delta_rule: {name} {list(t.shape)} must be [batch, seq, heads] = {[batch, seq, heads]}"
            )
    if initial_state is not None and tuple(initial_state.shape) != (batch, heads, k_dim, v.shape[-1]):
        raise ValueError(
            f"gated_delta_rule: initial_state {list(initial_state.shape)} must be "
            f"[batch, heads, k_dim, v_dim] = {[batch, heads, k_dim, v.shape[-1]]}"
        )


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, ...]:
    """Checked inputs in ``[B, H, T, ...]`` and the compute dtype; ``q`` normalised and scaled, the state."""
    check_gated_delta_rule_inputs(q, k, v, g, beta, initial_state)
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    g, beta = (t.transpose(1, 2).to(dtype) for t in (g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    batch, heads, _, k_dim = k.shape
    if initial_state is None:
        state = torch.zeros(batch, heads, k_dim, v.shape[-1], dtype=dtype, device=v.device)
    else:
        state = initial_state.to(dtype)
    return q, k, v, g, beta, state


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token; same arguments and results as :func:`gated_delta_rule_chunked`."""
    out_dtype = q.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        correction = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * correction[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape).transpose(1, 2)
    return out.to(out_dtype), (state if output_final_state else None)


def _chunk_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Everything that does not depend on the carried state, for all chunks at once.

    Inputs are ``[B, H, N, C, ...]`` (``N`` chunks of ``C`` tokens). Returns ``u`` and ``w_k``
    (the corrections are ``u - w_k S_0``), ``q_decayed`` (reads of ``S_0``), ``scores`` (the
    causal intra-chunk attention), ``k_to_end`` (keys decayed to the chunk's end) and the whole
    chunk's decay.
    """
    size = q.shape[-2]
    log_decay = g.cumsum(dim=-1)  # log Gamma_i: decay from the chunk's start through token i
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # Gamma_i / Gamma_j for j <= i (<= 1); the upper triangle is masked before exp so it cannot overflow.
    ratio = torch.where(causal, log_decay[..., :, None] - log_decay[..., None, :], -torch.inf).exp()
    k_beta = k * beta[..., None]
    strictly_lower = (k_beta @ k.transpose(-1, -2)) * ratio * ~torch.eye(size, dtype=torch.bool, device=q.device)
    system = strictly_lower + torch.eye(size, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, k_beta * log_decay[..., None].exp(), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * ratio
    q_decayed = q * log_decay[..., None].exp()
    k_to_end = k * (log_decay[..., -1:] - log_decay)[..., None].exp()
    chunk_decay = log_decay[..., -1].exp()[..., None, None]
    return u, w_k, q_decayed, scores, k_to_end, chunk_decay


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (the WY / UT-transform form).

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, H, V]``.
        g: ``[B, T, H]`` log decay (``<= 0``): the state is multiplied by ``exp(g_t)`` at token t.
        beta: ``[B, T, H]`` write strength.
        scale: multiplies the queries (default ``K ** -0.5``).
        initial_state: ``[B, H, K, V]`` state before the first token (default zeros).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise ``q`` and ``k`` first (FLA's eps).
        chunk_size: tokens per chunk; any length works (the last chunk is padded with tokens
            that neither decay nor write the state).

    Returns:
        The output ``[B, T, H, V]`` in ``q.dtype`` and the final state ``[B, H, K, V]`` (fp32,
        or fp64 for fp64 inputs) or ``None``.
    """
    if chunk_size < 1:
        raise ValueError(f"gated_delta_rule: chunk_size must be positive, got {chunk_size}")
    out_dtype, seq = q.dtype, q.shape[1]
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)
    pad = -seq % chunk_size
    # Padded tokens: g = 0 (no decay) and beta = 0 (no write) leave the state as it is.
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    batch, heads, length = g.shape
    q, k, v = (t.reshape(batch, heads, length // chunk_size, chunk_size, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(batch, heads, length // chunk_size, chunk_size) for t in (g, beta))
    u, w_k, q_decayed, scores, k_to_end, chunk_decay = _chunk_terms(q, k, v, g, beta)
    outputs = []
    for n in range(length // chunk_size):
        corrections = u[:, :, n] - w_k[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + scores[:, :, n] @ corrections)
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ corrections
    out = torch.cat(outputs, dim=2) if outputs else v.new_zeros(batch, heads, 0, v.shape[-1])
    out = out[:, :, :seq].transpose(1, 2)
    return out.to(out_dtype), (state if output_final_state else None)


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op's reference: :func:`gated_delta_rule_chunked` with FLA's chunk size (64)."""
    return gated_delta_rule_chunked(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def make_gated_delta_rule_inputs(
    batch: int,
    seq: int,
    heads: int,
    k_dim: int,
    v_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    with_state: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Random inputs shaped like a Gated DeltaNet layer's: ``(q, k, v, g, beta[, initial_state])``.

    ``g = -exp(A) * softplus(a)`` and ``beta = sigmoid(b)`` as the layer computes them, so the
    decays and write strengths have realistic ranges.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, k_dim, generator=gen)
    k = torch.randn(batch, seq, heads, k_dim, generator=gen)
    v = torch.randn(batch, seq, heads, v_dim, generator=gen)
    g = -torch.rand(heads, generator=gen).mul(2).exp() * F.softplus(torch.randn(batch, seq, heads, generator=gen))
    beta = torch.randn(batch, seq, heads, generator=gen).sigmoid()
    tensors = [q, k, v, g, beta]
    if with_state:
        tensors.append(0.1 * torch.randn(batch, heads, k_dim, v_dim, generator=gen))
    return tuple(t.to(device, dtype) for t in tensors)


def _cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    def make(*shape: int, seed: int, with_state: bool = False) -> tuple[torch.Tensor, ...]:
        return make_gated_delta_rule_inputs(*shape, dtype=dtype, device=device, seed=seed, with_state=with_state)

    q, k, v, g, beta, h0 = make(2, 70, 3, 16, 8, seed=1, with_state=True)
    return [
        Case("l2norm, 2 chunks", make(1, 96, 2, 16, 16, seed=0), {"use_qk_l2norm_in_kernel": True}),
        Case(
            "odd length, state in and out",
            (q, k, v, g, beta),
            {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True},
        ),
        Case("short, custom scale", make(2, 5, 2, 8, 12, seed=2), {"scale": 0.3, "use_qk_l2norm_in_kernel": True}),
    ]


def _bench(dtype: torch.dtype, device: torch.device) -> Case:
    # Qwen3-Next's head dims (128/128) on 4 heads and 128 tokens: the token-by-token naive
    # version takes ~25x the chunked time (seconds a call on a CPU) and keeps a few states per token.
    inputs = make_gated_delta_rule_inputs(1, 128, 4, 128, 128, dtype=dtype, device=device)
    return Case("1x128x4 heads, 128/128", inputs, {"use_qk_l2norm_in_kernel": True})


register_op(
    OpSpec(
        name="gated_delta_rule",
        reference=gated_delta_rule_reference,
        doc="Gated DeltaNet's linear-attention recurrence (chunked WY form), output and final state",
        cases=_cases,
        bench_case=_bench,
        naive=gated_delta_rule_recurrent,
        tolerances={torch.float32: Tolerance(atol=2e-5, rtol=2e-5), torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2)},
    )
)

# The token-by-token form as an implementation: never picked by "auto" (a chunk is cheaper for
# prompts), asked for by name where one token at a time is decoded from a cached state.
register_kernel("gated_delta_rule", "recurrent", priority=-1)(gated_delta_rule_recurrent)
