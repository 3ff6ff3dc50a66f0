"""Prepacked GEMM weights of the compiled decode step on the CPU (MKL's packed sgemm, fp32).

A decode step multiplies a few rows (the batch bucket) by every weight matrix of the model. With
so few rows MKL's plain ``sgemm`` spends much of its time re-laying out the weight for its
kernel, every call; ``cblas_sgemm_pack`` does that once, and a packed multiply of 8 rows costs
about 0.6x the plain one (a step's 17 GEMMs of the bench's model: 0.54 ms against 0.88 ms of
CPU, one thread). A pack is made for one row count, so each weight gets one pack per batch
bucket of at least :data:`PACK_MIN_ROWS` rows (memory: the packed weights once per such bucket).

This is what Inductor's ``freezing`` does for fp32 linears on the CPU, but freezing bakes the
weights into the graph as constants; here the packs are graph inputs that :meth:`PackedLinear.repack`
replaces after new weights arrive (RL weight sync), so nothing is compiled again.
The packed multiply enters the graph as an opaque custom op (Inductor lowers ``mkl._mkl_linear``
only for frozen constants).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from mindspeed.log import get_logger

logger = get_logger("mindspeed_llm.inference.engine")

#: Row counts below this keep the plain GEMM: packing measured no faster at 1 and 2 rows (MKL's
#: matrix-vector path is already lean there), 10 % faster at 4, 1.6x at 8, 1.4x at 16 (the bench's shapes).
PACK_MIN_ROWS = 4
#: Auto mode packs a model's weights only while the packs (one copy per bucket) stay under this.
AUTO_MAX_BYTES = 2 * 1024**3


# Defined with the low-level library API rather than ``torch.library.custom_op``: a custom op's Python
# wrappers cost ~20 us a call, more than the packing saves on a small GEMM; this one costs ~3 us.
_LIBRARY = torch.library.Library("mindspeed", "FRAGMENT")
_LIBRARY.define("mkl_packed_linear(Tensor x, Tensor packed, Tensor weight, Tensor? bias) -> Tensor")


def _mkl_packed_linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of ``x`` ``[rows, in]`` with ``packed``, MKL's pack of ``weight`` for ``rows``."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


# CompositeExplicitAutograd: the packed weight is an MKL-DNN tensor, whose dispatch key a CPU kernel would not match.
_LIBRARY.impl("mkl_packed_linear", _mkl_packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("mindspeed::mkl_packed_linear", lib=_LIBRARY)
def _(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def mkl_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether MKL's packed sgemm serves this device and dtype (the CPU, fp32, a torch built with MKL)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)


class PackedLinear:
    """``linear(x, weight, bias)`` that multiplies by a weight's pack for ``x``'s row count when it has one.

    Calls with a weight it does not hold, or a row count without a pack, are plain ``F.linear``.

    Args:
        weights: the weight matrices ``[out, in]`` to pack (duplicates, e.g. tied embeddings, once).
        rows: the row counts to pack them for (the batch buckets).
    """

    def __init__(self, weights: Iterable[torch.Tensor], rows: Sequence[int]) -> None:
        self.rows = tuple(rows)
        self.packs: dict[torch.Tensor, dict[int, torch.Tensor]] = {}
        for weight in weights:
            if weight not in self.packs:
                self.packs[weight] = {m: _pack(weight, m) for m in self.rows}

    @property
    def nbytes(self) -> int:
        """Bytes of the packs."""
        return sum(p.numel() * p.element_size() for packs in self.packs.values() for p in packs.values())

    def repack(self) -> None:
        """Pack every weight again (after its values changed in place).

        The new packs replace the old ones in :attr:`packs`, which the graphs read as inputs at each
        call (their guards check a pack's shape and dtype, not its identity), so nothing is compiled
        again. (``copy_`` into an MKL-DNN tensor would not do: it takes the source's buffer, which is
        then freed.)
        """
        with torch.no_grad():
            for weight, packs in self.packs.items():
                for rows in packs:
                    packs[rows] = _pack(weight, rows)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packs = self.packs.get(weight)
        if packs is None or x.dim() != 2 or x.shape[0] not in packs:
            return F.linear(x, weight, bias)
        return torch.ops.mindspeed.mkl_packed_linear(x, packs[x.shape[0]], weight, bias)


def decode_weights(model) -> list[torch.Tensor]:
    """The weight matrices a dense decode step multiplies by: per layer q/k/v, output projection, MLP in and out;
    then the output layer."""
    weights = []
    for layer in model.layers:
        weights += [w for w in (layer.qkv_weight, layer.proj, layer.fc1, layer.fc2) if w is not None and w.dim() == 2]
    return [*weights, model.output]


def estimate_bytes(weights: Sequence[torch.Tensor], buckets: int) -> int:
    """Bytes the packs of ``weights`` take for ``buckets`` row counts (one trial pack per weight shape:
    MKL's packed layout pads, and torch allocates it generously, ~7x the weight for a 1408 x 256 fp32 one)."""
    unique = {id(w): w for w in weights}.values()
    per_shape: dict[tuple[int, ...], int] = {}
    for weight in unique:
        if weight.shape not in per_shape:
            packed = _pack(weight, 1)
            per_shape[weight.shape] = packed.numel() * packed.element_size()
    return buckets * sum(per_shape[w.shape] for w in unique)
