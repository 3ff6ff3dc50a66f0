"""``--swap-optimizer``: the distributed optimizer's fp32 state lives in host memory between steps.

The distributed optimizer's per-rank state is the fp32 master shard and Adam's two moments:
12 bytes per parameter of the shard (8 in fp32 training, where the master is the model's own
weight and stays). Here they are kept in host memory (pinned where the accelerator has it) and
only their logical tensors stay on the device (storage resized to zero). At ``step()`` the
parameters go through the device in ``times`` chunks: copy the chunk's state host -> device on
a side stream, step it on the compute stream, copy the master to the bf16 weights (megatron's
cast), copy the state device -> host on the side stream and free the device storage once that
copy is done. The compute stays on the device (unlike megatron-core's ``optimizer_cpu_offload``,
which steps on the host). Streams, events and host buffers come from the accelerator seam;
on the CPU copies are synchronous, and host buffers are tagged
(:func:`mindspeed.metrics.memory.mark_host`) so the dispatch-level memory tracker counts only
the "device pool".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed.memory.optimizer_step import (
    ChunkedStep,
    MasterPair,
    is_distributed,
    master_pairs,
    materialize_before_state_methods,
    split_chunks,
    sub_optimizers,
)
from mindspeed.metrics.memory import mark_host, resize_storage, untracked

logger = get_logger(__name__)

#: Default number of chunks (MindSpeed's ``--swap-optimizer-times``).
DEFAULT_TIMES = 16


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for ``tensor``'s data, pinned where the accelerator pins, tagged as host."""
    with untracked():
        host = get_accelerator().empty_host(tensor.shape, dtype=tensor.dtype)
    return mark_host(host)


@dataclass
class SwapOptimizer:
    """A ``post_optimizer_build`` hook: keep the distributed optimizer's fp32 state on the host.

    Attributes:
        times: chunks per step (``--swap-optimizer-times``).
        steps: the chunked step of each megatron optimizer, after :meth:`install`.
        device_bytes_swapped: bytes of optimizer state kept off the device between steps
            (masters once installed, moments from the first step on).
    """

    times: int = DEFAULT_TIMES
    steps: list[ChunkedStep] = field(default_factory=list)
    device_bytes_swapped: int = 0
    _host: dict[int, torch.Tensor] = field(default_factory=dict)
    _inner_of: dict[int, Any] = field(default_factory=dict)

    def install(self, optimizer: Any) -> Any:
        """Move the state of ``optimizer`` (megatron's distributed optimizer) to the host.

        Returns:
            ``optimizer`` itself (changed in place).

        Raises:
            ValueError: the optimizer is not megatron's distributed optimizer.
        """
        if not is_distributed(optimizer):
            raise ValueError(
                "swap_optimizer needs megatron's distributed optimizer (it swaps this rank's shard of "
                "the optimizer state); set parallel.distributed_optimizer=true "
                "(OptimizerConfig(use_distributed_optimizer=True)) or turn the feature off"
            )
        acc = get_accelerator()
        self._side = acc.stream()
        for sub in sub_optimizers(optimizer):
            pairs = master_pairs(sub)
            for pair in pairs:
                self._inner_of[id(pair.main)] = sub.optimizer
                if pair.model is not None:  # the fp32 master; in fp32 training it is the weight itself
                    self._send_out([pair.main], wait=True)
            self.steps.append(ChunkedStep(sub, split_chunks(pairs, self.times), self._bring_in, self._send_out_chunk))
            materialize_before_state_methods(sub, self.materialize)
        logger.info(
            "swap_optimizer: %d chunks per step, %d bytes of state on the host",
            sum(len(s.chunks) for s in self.steps),
            self.device_bytes_swapped,
        )
        return optimizer

    def _state_tensors(self, pair: MasterPair) -> list[torch.Tensor]:
        state = self._inner_of[id(pair.main)].state.get(pair.main, {})
        tensors = [value for value in state.values() if torch.is_tensor(value) and value.numel() == pair.numel]
        return ([pair.main] if pair.model is not None else []) + tensors

    def _bring_in(self, chunk: list[MasterPair]) -> None:
        acc = get_accelerator()
        compute = acc.current_stream()
        arriving = []
        for pair in chunk:
            for tensor in self._state_tensors(pair):
                host = self._host.get(id(tensor))
                # None: state this step creates (Adam's moments at the first step, or tensors a
                # checkpoint load put in); a non-empty storage is resident already (materialized).
                if host is not None and tensor.untyped_storage().nbytes() == 0:
                    # Allocated on the compute stream, which uses it; the side stream only fills it.
                    resize_storage(tensor, tensor.numel() * tensor.element_size())
                    arriving.append((tensor, host))
        self._side.wait_stream(compute)
        with acc.use_stream(self._side):
            with torch.no_grad():
                for tensor, host in arriving:
                    tensor.copy_(host, non_blocking=True)
            arrived = self._side.record_event()
        compute.wait_event(arrived)

    def materialize(self) -> None:
        """Bring the whole state back; it stays until the next step (checkpoints read and write it)."""
        for step in self.steps:
            for chunk in step.chunks:
                self._bring_in(chunk)

    def _send_out_chunk(self, chunk: list[MasterPair]) -> None:
        self._send_out([t for pair in chunk for t in self._state_tensors(pair)], wait=True)

    def _send_out(self, tensors: list[torch.Tensor], wait: bool) -> None:
        acc = get_accelerator()
        compute = acc.current_stream()
        self._side.wait_stream(compute)
        with acc.use_stream(self._side):
            for tensor in tensors:
                host = self._host.get(id(tensor))
                if host is None:
                    host = self._host[id(tensor)] = _host_buffer(tensor)
                    self.device_bytes_swapped += tensor.numel() * tensor.element_size()
                with torch.no_grad():
                    host.copy_(tensor, non_blocking=True)
            done = self._side.record_event()
        if wait:
            done.synchronize()  # the device storage may only go once its copy has left
        for tensor in tensors:
            resize_storage(tensor, 0)
