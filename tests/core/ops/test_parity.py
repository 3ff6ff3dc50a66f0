"""Every implementation of every op equals the pure-PyTorch reference, forward and backward.

The cases come from each op's ``OpSpec.cases`` (odd shapes included); implementations that
are not available on this machine are not collected, so on a GPU or NPU host the same test
covers the vendor kernels.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed.device import get_accelerator
from mindspeed.ops import KERNELS, OPS, available_kernels, list_kernels
from mindspeed.testing.parity import compare_case


def _params():
    device = get_accelerator().name
    for op in OPS.keys():
        spec = OPS.get(op)
        for impl in available_kernels(op, device):
            if impl.name == "reference":
                continue
            # Compiling costs ~15 s per op and dtype on a 2-core CPU: fp32 proves the compiled
            # graph; the other dtypes are covered by the slow marker.
            for dtype in spec.dtypes:
                marks = [pytest.mark.slow] if impl.name == "compile" and dtype != torch.float32 else []
                yield pytest.param(op, impl.name, dtype, id=f"{op}-{impl.name}-{str(dtype)[6:]}", marks=marks)


@pytest.mark.parametrize(("op", "impl_name", "dtype"), list(_params()))
def test_matches_reference(op: str, impl_name: str, dtype: torch.dtype) -> None:
    spec = OPS.get(op)
    impl, reference = KERNELS.get((op, impl_name)), KERNELS.get((op, "reference"))
    device = get_accelerator().device()
    problems = []
    for case in spec.cases(dtype, device):
        if impl.supports(case.features):
            problems += compare_case(spec, impl, reference, case, dtype)
    assert not problems, "\n".join(problems)


def test_every_op_has_cases_and_a_bench_case() -> None:
    device = torch.device("cpu")
    for op in OPS.keys():
        spec = OPS.get(op)
        assert spec.doc, f"{op}: no doc line"
        for dtype in spec.dtypes:
            assert len(spec.cases(dtype, device)) >= 2, f"{op}: needs several parity cases (odd shapes too)"
        assert spec.bench_case is not None, f"{op}: no bench_case for tools/bench/ops.py"


def test_reference_is_registered_for_every_op() -> None:
    for op in OPS.keys():
        names = [impl.name for impl in list_kernels(op)]
        assert "reference" in names, op
