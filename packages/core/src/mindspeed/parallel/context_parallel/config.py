"""The typed config of context parallelism, with MindSpeed's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mindspeed.parallel.context_parallel.layout import (
    HYBRID,
    KVALLGATHER,
    RING,
    ULYSSES,
    check_degrees,
    check_window_size,
)
from mindspeed.parallel.context_parallel.ulysses import check_ulysses_heads

Algo = Literal["ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo", "kvallgather_cp_algo", "adaptive_cp_algo"]


@dataclass
class ContextParallelConfig:
    """Context parallelism (MindSpeed's ``--context-parallel-*`` flags).

    Attributes:
        context_parallel_size: CP degree ``C`` (``--context-parallel-size``).
        context_parallel_algo: ``ulysses_cp_algo`` (all-to-all over heads),
            ``megatron_cp_algo`` (ring attention, MindSpeed's default) or ``hybrid_cp_algo``
            (Ulysses inside a ring) or ``kvallgather_cp_algo`` (zig-zag queries against the
            all-gathered keys and values) or ``adaptive_cp_algo`` (ring, KV all-gather or no
            communication, chosen per call from the mask's non-empty blocks)
            (``--context-parallel-algo``).
        ulysses_degree_in_cp: Ulysses degree ``U`` of ``hybrid_cp_algo``; the ring degree is
            ``C / U`` (``--ulysses-degree-in-cp``).
        cp_window_size: ``w > 1`` runs the ring as a double ring: windows of ``w`` consecutive
            CP ranks (an inner ring, usually one node) and an outer ring over the windows
            (``--cp-window-size``; must divide ``C`` and be below it; 1 is the plain ring).
        use_cp_send_recv_overlap: overlap each ring transfer with the current block's compute
            (``--use-cp-send-recv-overlap``; on by default here: turning it off only helps to
            measure what the overlap buys).
        attention_impl: the ``attention`` kernel (``"auto"``, ``"reference"``, ``"sdpa"``,
            ``"flash_attn"``, ``"npu"``); ring attention needs one that returns ``lse``.
    """

    context_parallel_size: int = 1
    context_parallel_algo: Algo = RING
    ulysses_degree_in_cp: int | None = None
    cp_window_size: int = 1
    use_cp_send_recv_overlap: bool = True
    attention_impl: str = "auto"

    def __post_init__(self) -> None:
        if self.context_parallel_algo == HYBRID and self.ulysses_degree_in_cp is None:
            raise ValueError("hybrid_cp_algo needs ulysses_degree_in_cp (the Ulysses degree; ring degree = C / U)")
        check_degrees(self.context_parallel_size, self.context_parallel_algo, self.ulysses_degree)
        check_window_size(self.context_parallel_size, self.context_parallel_algo, self.cp_window_size)

    @property
    def ulysses_degree(self) -> int:
        """Ranks that split heads: ``C`` for Ulysses, ``U`` for hybrid, 1 for ring."""
        if self.context_parallel_algo == ULYSSES:
            return self.context_parallel_size
        if self.context_parallel_algo == HYBRID:
            return int(self.ulysses_degree_in_cp or 1)
        return 1

    @property
    def ring_degree(self) -> int:
        """Ranks in the ring: ``C`` for ring, ``C / U`` for hybrid, 1 for Ulysses and KV all-gather."""
        if self.context_parallel_algo == KVALLGATHER:
            return 1
        return self.context_parallel_size // self.ulysses_degree

    def check_heads(self, num_heads: int, num_kv_heads: int, tensor_parallel_size: int = 1) -> None:
        """Raise ``ValueError`` when the model's heads cannot be split by the Ulysses degree.

        Args:
            num_heads: query heads of the model.
            num_kv_heads: key/value heads of the model.
            tensor_parallel_size: TP degree (heads are split by TP first).
        """
        if num_heads % tensor_parallel_size or num_kv_heads % tensor_parallel_size:
            raise ValueError(
                f"heads ({num_heads} q, {num_kv_heads} kv) must divide by tensor_parallel_size ({tensor_parallel_size})"
            )
        tp = tensor_parallel_size
        check_ulysses_heads(num_heads // tp, num_kv_heads // tp, self.ulysses_degree)
