"""What the distributed context-parallel tests run in every rank: each algorithm against full attention.

Every rank builds the same full ``q, k, v`` and output cotangent from a seed, computes the
single-rank reference (``attention_reference`` on the whole sequence) and its gradients, then
runs the CP algorithm on its own shard and compares its output rows and its shard's
``dq, dk, dv`` with the matching slices of the reference. Every comparison of a group is
collected into one report; the test asserts on it at the end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from mindspeed.ops.alibi import get_alibi_slopes
from mindspeed.ops.attention import attention_reference
from mindspeed.parallel.context_parallel import (
    ADAPTIVE,
    HYBRID,
    KVALLGATHER,
    RING,
    ULYSSES,
    ContextParallelAttention,
    ContextParallelConfig,
    build_context_parallel_groups,
    choose_cp_algo,
    context_parallel_attention,
    gather_from_context_parallel,
    split_for_context_parallel,
)

TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


@dataclass(frozen=True)
class CpCase:
    """One configuration: an algorithm, a shape and the optional features."""

    algo: str
    seq_len: int
    heads_q: int = 4
    heads_kv: int = 4
    batch: int = 2
    dim: int = 8
    causal: bool = True
    cu_seqlens: tuple[int, ...] | None = None
    ulysses_degree: int = 1
    impl: str = "reference"
    overlap: bool = True
    dtype: str = "float32"
    window: int = -1  # a causal sliding window's left bound (kvallgather_cp_algo)
    alibi: bool = False
    cp_window: int = 1  # the double ring's window (cp_window_size)

    @property
    def name(self) -> str:
        parts = [self.algo.replace("_cp_algo", "")]
        if self.algo == HYBRID:
            parts.append(f"u{self.ulysses_degree}")
        if self.cp_window > 1:
            parts.append(f"window-of-{self.cp_window}-ranks")
        parts += [f"s{self.seq_len}", f"h{self.heads_q}/{self.heads_kv}", "causal" if self.causal else "full"]
        if self.cu_seqlens is not None:
            parts.append(f"packed{list(self.cu_seqlens)}")
        if self.impl != "reference":
            parts.append(self.impl)
        if not self.overlap:
            parts.append("no-overlap")
        if self.dtype != "float32":
            parts.append(self.dtype)
        if self.window >= 0:
            parts.append(f"window{self.window}")
        if self.alibi:
            parts.append("alibi")
        return " ".join(parts)


def _run_case(case: CpCase, index: int, rank: int, world_size: int, groups_cache: dict) -> dict:
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(1000 + index)
    batch = 1 if case.cu_seqlens is not None else case.batch

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(batch, case.seq_len, heads, case.dim, generator=gen).to(dtype)

    q, k, v = rand(case.heads_q), rand(case.heads_kv), rand(case.heads_kv)
    grad_out = rand(case.heads_q)
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int32)

    masks = {}
    if case.window >= 0:
        masks["window_size"] = (case.window, 0)
    if case.alibi:
        masks["alibi_slopes"] = get_alibi_slopes(case.heads_q)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = attention_reference(*leaves, causal=case.causal, cu_seqlens=cu, **masks)
    ref_grads = torch.autograd.grad(ref_out, leaves, grad_out)

    key = (case.algo, case.ulysses_degree, case.cp_window)
    if key not in groups_cache:
        groups_cache[key] = build_context_parallel_groups(
            dist.group.WORLD, case.algo, case.ulysses_degree, cp_window_size=case.cp_window
        )
    groups = groups_cache[key]

    def split(t: torch.Tensor) -> torch.Tensor:
        return split_for_context_parallel(
            t, 1, groups.cp_rank, world_size, case.algo, ulysses_degree=case.ulysses_degree
        )

    local = [split(t).detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = context_parallel_attention(
        *local,
        algo=case.algo,
        cp_group=groups.cp_group,
        ulysses_group=groups.ulysses_group,
        ring_group=groups.ring_group,
        causal=case.causal,
        cu_seqlens=cu,
        # Aligned lengths exercise the default (local length x C); unaligned ones must be given.
        seq_len=None if case.seq_len % (2 * world_size) == 0 else case.seq_len,
        impl=case.impl,
        overlap=case.overlap,
        inner_ring_group=groups.inner_ring_group,
        outer_ring_group=groups.outer_ring_group,
        **masks,
    )
    grads = torch.autograd.grad(out, local, split(grad_out))
    # The full output, gathered back from the shards (the data side's inverse of the split).
    gathered = gather_from_context_parallel(
        out.detach(), 1, groups.cp_group, case.algo, seq_len=case.seq_len, ulysses_degree=case.ulysses_degree
    )
    pairs = [
        ("out", out, split(ref_out)),
        ("dq", grads[0], split(ref_grads[0])),
        ("dk", grads[1], split(ref_grads[1])),
        ("dv", grads[2], split(ref_grads[2])),
        ("gathered", gathered, ref_out),
    ]
    name = case.name
    if case.algo == ADAPTIVE:  # which algorithm the mask chose, for the report
        choice = choose_cp_algo(
            case.seq_len,
            world_size,
            case.causal,
            case.cu_seqlens,
            tuple(masks.get("window_size", (-1, -1))),
            case.alibi,
        )
        name += f" -> {choice.algo}"
    return _report(name, pairs, *TOLERANCES[dtype])


def _check_extras(rank: int, world_size: int) -> list[dict]:
    """The gather's gradient, the module-style entry and the user errors, on the world group."""
    group = dist.group.WORLD
    reports = []
    # gather_from_context_parallel: every rank weighs the full tensor differently; the shard's
    # gradient is the sum of those weights at its positions.
    seq_len = 11
    full = torch.randn(1, seq_len, 3, generator=torch.Generator().manual_seed(7))
    weights = torch.randn(world_size, 1, seq_len, 3, generator=torch.Generator().manual_seed(8))
    local = split_for_context_parallel(full, 1, rank, world_size, RING).clone().requires_grad_(True)
    gathered = gather_from_context_parallel(local, 1, group, RING, seq_len=seq_len)
    (grad,) = torch.autograd.grad((gathered * weights[rank]).sum(), local)
    want = split_for_context_parallel(weights.sum(0), 1, rank, world_size, RING)
    reports.append(_report("gather forward + backward", [("full", gathered, full), ("grad", grad, want)]))

    # ContextParallelAttention: config and groups fixed at build time, same numbers as the function.
    config = ContextParallelConfig(world_size, RING, attention_impl="reference")
    attn = ContextParallelAttention(config, build_context_parallel_groups(group, RING))
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    ref = attention_reference(q, k, v, causal=True)
    shards = [split_for_context_parallel(t, 1, rank, world_size, RING) for t in (q, k, v)]
    want = split_for_context_parallel(ref, 1, rank, world_size, RING)
    reports.append(_report("ContextParallelAttention", [("out", attn(*shards), want)]))

    # Megatron's [s, b, n, d] shards, passed as (non-contiguous) BSND views.
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 12, 4, 8, generator=gen) for _ in range(3))
    ref = attention_reference(q, k, v, causal=True)
    for algo in (RING, ULYSSES):
        sbnd = [
            split_for_context_parallel(t.transpose(0, 1).contiguous(), 0, rank, world_size, algo) for t in (q, k, v)
        ]
        views = [t.transpose(0, 1) for t in sbnd]
        out = context_parallel_attention(*views, algo=algo, cp_group=group, impl="reference")
        want = split_for_context_parallel(ref.transpose(0, 1), 0, rank, world_size, algo)
        reports.append(_report(f"{algo} on [s, b, n, d] views", [("out", out.transpose(0, 1), want)]))

    # User errors are raised on every rank before any communication, with the fix in the message.
    errors = {}
    for label, call, pattern in [
        ("shards that do not match seq_len", lambda: attn(*shards, seq_len=13), "pass seq_len"),
        ("unknown algo", lambda: context_parallel_attention(*shards, algo="ring", cp_group=group), "use one of"),
        (
            "hybrid without groups",
            lambda: context_parallel_attention(*shards, algo=HYBRID, cp_group=group),
            "build_context_parallel_groups",
        ),
        (
            "window with the ring",
            lambda: context_parallel_attention(*shards, algo=RING, cp_group=group, window_size=(3, 0)),
            "kvallgather_cp_algo",
        ),
        (
            "ALiBi with hybrid",
            lambda: context_parallel_attention(
                *shards, algo=HYBRID, cp_group=group, alibi_slopes=get_alibi_slopes(shards[0].shape[2])
            ),
            "megatron_cp_algo, kvallgather_cp_algo or adaptive_cp_algo",
        ),
        (
            "window without a causal mask",
            lambda: context_parallel_attention(
                *shards, algo=KVALLGATHER, cp_group=group, causal=False, window_size=(3, 0)
            ),
            "only under a causal mask",
        ),
        (
            "heads not divisible",
            lambda: context_parallel_attention(*[t[:, :8, :1] for t in shards], algo=ULYSSES, cp_group=group),
            "divisible by the Ulysses degree",
        ),
    ]:
        try:
            call()
            errors[label] = {"max_abs": 0.0, "ok": False}
        except ValueError as err:
            errors[label] = {"max_abs": 0.0, "ok": pattern in str(err)}
    reports.append({"case": "user errors", "diffs": errors, "ok": all(d["ok"] for d in errors.values())})
    return reports


def _report(name: str, pairs: list, atol: float = 2e-5, rtol: float = 1e-5) -> dict:
    """Max abs difference and pass/fail of each ``(label, got, want)``."""
    diffs = {}
    for label, got, want in pairs:
        got, want = got.detach().float(), want.detach().float()
        same_shape = got.shape == want.shape
        ok = same_shape and torch.allclose(got, want, atol=atol, rtol=rtol)
        max_abs = float((got - want).abs().max()) if same_shape and got.numel() else float("nan")
        diffs[label] = {"max_abs": max_abs, "ok": bool(ok)}
    return {"case": name, "diffs": diffs, "ok": all(d["ok"] for d in diffs.values())}


def check_cases(rank: int, world_size: int, cases: list[dict], extras: bool = True) -> list[dict]:
    """Run every case (and the extra checks) on this rank; returns one report per case.

    A case that raises fails the whole group (run_distributed reports the traceback): carrying
    on would leave the other ranks waiting in a collective.
    """
    groups_cache: dict = {}
    reports = [_run_case(CpCase(**fields), index, rank, world_size, groups_cache) for index, fields in enumerate(cases)]
    return reports + (_check_extras(rank, world_size) if extras else [])


def case_dicts(cases: list[CpCase]) -> list[dict]:
    """Picklable form of ``cases`` for the spawned ranks."""
    return [asdict(c) for c in cases]
