"""Grouped matmul: one matrix product per expert over rows already grouped by expert.

This is what megatron-core's ``GroupedMLP`` computes with ``grouped_gemm.ops.gmm`` (its
weights viewed as ``[num_experts, in, out]``, ``trans_b=False``), and what ``SequentialMLP``
computes one expert at a time. Rows of expert ``e`` are ``x[start_e:start_e + n_e]``, with
``n = tokens_per_expert`` and experts in order; experts with no rows are allowed.

Numerics: every expert's product is a plain ``x_e @ weight[e]`` in the input dtype. For
half-precision inputs the matmul kernels accumulate in fp32 and round the result once, as
``torch.matmul`` and grouped GEMM kernels do; nothing is up-cast explicitly, so the reference
equals a per-expert (or per-token) ``torch.matmul`` in that dtype.
"""

from __future__ import annotations

import torch

from mindspeed.device import get_accelerator
from mindspeed.ops.registry import Case, OpSpec, Tolerance, register_kernel, register_op


def check_grouped_matmul_args(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
    """Raise ``ValueError`` unless shapes and dtypes fit ``grouped_matmul`` (no host sync)."""
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(
            f"grouped_matmul needs x [tokens, in] and weight [experts, in, out]; got x {list(x.shape)} "
            f"and weight {list(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"grouped_matmul: x has {x.shape[1]} input features but weight expects {weight.shape[1]} "
            "(weight must be [experts, in, out]; transpose a [experts, out, in] weight first)"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"grouped_matmul: x is {x.dtype} but weight is {weight.dtype}; cast one of them")
    if tokens_per_expert.dim() != 1 or tokens_per_expert.numel() != weight.shape[0]:
        raise ValueError(
            f"grouped_matmul: tokens_per_expert must be a vector of {weight.shape[0]} counts (one per "
            f"expert), got shape {list(tokens_per_expert.shape)}"
        )


def _check_total(sizes: list[int], x: torch.Tensor) -> None:
    if sum(sizes) != x.shape[0] or min(sizes, default=0) < 0:
        raise ValueError(
            f"grouped_matmul: tokens_per_expert {sizes} must be non-negative and sum to the {x.shape[0]} rows of x"
        )


def grouped_matmul_reference(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Rows of each expert multiplied by that expert's weight, one matmul per expert.

    Args:
        x: ``[tokens, in]``, rows grouped by expert (expert 0's rows first).
        weight: ``[experts, in, out]``, same dtype as ``x``.
        tokens_per_expert: int ``[experts]`` row counts summing to ``tokens`` (zeros allowed);
            on the CPU or the device (read on the host here, which synchronises).

    Returns:
        ``[tokens, out]`` in ``x``'s dtype.

    Raises:
        ValueError: on inconsistent shapes, dtypes or counts.
    """
    check_grouped_matmul_args(x, weight, tokens_per_expert)
    sizes = [int(n) for n in tokens_per_expert.tolist()]
    _check_total(sizes, x)
    outputs = [rows @ weight[e] for e, rows in enumerate(torch.split(x, sizes))]
    if not outputs:  # no experts at all (and hence no rows)
        return x.new_zeros(0, weight.shape[2])
    return torch.cat(outputs)


def _grouped_matmul_naive(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Naive version, as Hugging Face MoE blocks write it: a boolean mask per expert."""
    expert_of_row = torch.repeat_interleave(
        torch.arange(weight.shape[0], device=x.device), tokens_per_expert.to(x.device)
    )
    out = x.new_zeros(x.shape[0], weight.shape[2])
    for e in range(weight.shape[0]):
        mask = expert_of_row == e
        out[mask] = x[mask] @ weight[e]
    return out


# -- cases ---------------------------------------------------------------------------------------


def _make(
    counts: list[int],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    counts_on_device: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(sum(counts), in_features, generator=gen).to(device, dtype)
    weight = (torch.randn(len(counts), in_features, out_features, generator=gen) / in_features**0.5).to(device, dtype)
    tokens = torch.tensor(counts, dtype=torch.int64)
    return x, weight, tokens.to(device) if counts_on_device else tokens


def _cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    return [
        Case("4 experts aligned", _make([7, 12, 3, 10], 64, 32, dtype, device, gen)),
        Case("zero-token experts", _make([0, 9, 0, 0, 17, 0], 32, 48, dtype, device, gen)),
        Case("odd sizes", _make([5, 1, 13], 33, 17, dtype, device, gen)),
        Case("one expert", _make([11], 16, 24, dtype, device, gen)),
        Case("counts on device", _make([6, 0, 10, 4], 48, 64, dtype, device, gen, counts_on_device=True)),
        Case("no tokens", _make([0, 0], 16, 16, dtype, device, gen)),
    ]


def _bench(dtype: torch.dtype, device: torch.device) -> Case:
    gen = torch.Generator().manual_seed(0)
    counts = [512 + 64 * (e % 3) - 64 for e in range(8)]  # uneven, sums to 4096
    counts[-1] += 4096 - sum(counts)
    return Case("T=4096 in=512 out=1024 E=8", _make(counts, 512, 1024, dtype, device, gen))


register_op(
    OpSpec(
        name="grouped_matmul",
        reference=grouped_matmul_reference,
        doc="one matmul per expert over rows grouped by expert (MoE experts, GroupedMLP's gmm)",
        cases=_cases,
        bench_case=_bench,
        naive=_grouped_matmul_naive,
        # Different blocking of the same fp32 sums; half-precision defaults hold.
        tolerances={torch.float32: Tolerance(atol=1e-4, rtol=1e-4)},
    )
)


# -- "native": torch._grouped_mm ---------------------------------------------------------------

#: (device type, dtype) -> whether torch._grouped_mm matches a per-expert loop there, forward and
#: backward (probed once; a failing or wrong kernel counts as unusable).
_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    key = (device.type, dtype)
    if key not in _PROBED:
        _PROBED[key] = _run_probe(device, dtype)
    return _PROBED[key]


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with an explicit backward of two more grouped GEMMs.

    torch's own derivative hands the incoming gradient to the kernel as it comes, and the kernel
    rejects the stride-0 gradients that ``out.sum().backward()`` produces; here it is made
    contiguous first. ``dx = dy @ W^T`` per group, ``dW[e] = x_e^T @ dy_e`` (groups along K).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        return torch._grouped_mm(x, weight, offs=offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = torch._grouped_mm(grad_out, weight.transpose(1, 2), offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = torch._grouped_mm(x.t(), grad_out, offs=offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def _run_probe(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # Uneven groups with an empty one: the cases where a kernel's alignment or empty-group
        # handling would show. Small integers keep every product exact in any dtype.
        sizes = [5, 0, 11]
        x = (torch.arange(16 * 32, device=device) % 5 - 2).reshape(16, 32).to(dtype).requires_grad_(True)
        w = (torch.arange(3 * 32 * 16, device=device) % 3 - 1).reshape(3, 32, 16).to(dtype).requires_grad_(True)
        offsets = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
        y = _GroupedMM.apply(x, w, offsets)
        (y * (torch.arange(16, device=device) % 3).to(dtype).unsqueeze(1)).sum().backward()
        x2, w2 = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        y2 = torch.cat([rows @ w2[e] for e, rows in enumerate(torch.split(x2, sizes))])
        (y2 * (torch.arange(16, device=device) % 3).to(dtype).unsqueeze(1)).sum().backward()
        return bool(torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def _grouped_mm_available() -> bool:
    device = get_accelerator().device()
    return any(_probe_grouped_mm(device, dtype) for dtype in (torch.bfloat16, torch.float32))


def _fits_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch._grouped_mm wants 16-byte aligned base pointers and row strides (TMA on GPUs).
    step = 16 // x.element_size()
    return (
        x.shape[0] > 0
        and x.shape[1] % step == 0
        and weight.shape[2] % step == 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
        and _probe_grouped_mm(x.device, x.dtype)
    )


@register_kernel("grouped_matmul", "native", priority=10, available=_grouped_mm_available)
def grouped_matmul_native(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torch's own grouped GEMM (``torch._grouped_mm``; a CUTLASS kernel for bf16 on recent GPUs).

    Used where a probe showed it matches a per-expert loop for this device and dtype and the
    feature sizes are 16-byte aligned; otherwise (odd sizes, no rows) the reference loop runs.
    Offsets go to the kernel on the device, so no host synchronisation is needed when the counts
    live there (the sum of the counts is then not checked).
    """
    check_grouped_matmul_args(x, weight, tokens_per_expert)
    if tokens_per_expert.device.type == "cpu":
        _check_total([int(n) for n in tokens_per_expert.tolist()], x)
    x, weight = x.contiguous(), weight.contiguous()
    if not _fits_grouped_mm(x, weight):
        return grouped_matmul_reference(x, weight, tokens_per_expert)
    offsets = tokens_per_expert.to(x.device, non_blocking=True).cumsum(0).to(torch.int32)
    return _GroupedMM.apply(x, weight, offsets)
