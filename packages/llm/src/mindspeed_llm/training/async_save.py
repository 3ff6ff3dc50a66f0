"""Asynchronous checkpoints (``checkpoint.async_save``): training goes on while the files are written.

:func:`start_checkpoint` does, on every rank, what must happen with the step stopped: the check for
non-finite state, megatron's save planning (collectives) and the common state, and the staging of
this rank's tensors (a copy in host memory, so that the next steps' in-place updates cannot reach
the files). A background thread then writes the files (megatron's writers, forked from it) and
returns. :class:`PendingSave` is the save in flight: :meth:`PendingSave.written` says whether this
rank's files are written, :meth:`PendingSave.finish` (collective) gathers every rank's write results,
writes the metadata and only then completes the checkpoint (``complete.json``, the rename of
``iter_N.tmp`` to ``iter_N``, the tracker) and rotates. A save in flight is therefore never a resume
point: a run killed before ``finish`` leaves ``iter_N.tmp`` without a marker, and the next run resumes
from the newest complete checkpoint and removes it. The trainer keeps at most one save in flight.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing import forked_children_die_with_me, rotate, save_guard
from mindspeed.log import get_logger
from mindspeed_llm.training.checkpoint import TrainState, check_savable, complete_checkpoint, write_checkpoint

logger = get_logger(__name__)


def _staged(request: Any) -> Any:
    """``request`` with every tensor it will write copied to host memory (megatron's own staging only moves
    device tensors, and would write live CPU tensors as the next steps change them)."""
    if request.async_fn is None:  # nothing to write on this rank
        return request
    rank, buckets, *rest = request.async_fn_args
    with torch.no_grad():
        copies = [
            (name, key, (data, [(item, t.detach().to("cpu", copy=True)) for item, t in tensors]))
            for name, key, (data, tensors) in buckets
        ]
    return request._replace(async_fn_args=(rank, copies, *rest), preload_fn=None)


class PendingSave:
    """One checkpoint whose files a background thread is writing (see the module docstring)."""

    def __init__(self, request: Any, root: Path, final: Path, step: int, config: Any, keep_last: int | None) -> None:
        self.root, self.final, self.step = root, final, step
        self._request, self._config, self._keep_last = request, config, keep_last
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name=f"checkpoint-writer-{step}", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        request = self._request
        try:
            if request.async_fn is not None:
                with forked_children_die_with_me():  # the writers it forks die with this process
                    request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
        except BaseException as err:  # re-raised by finish(), in the training thread
            self._error = err

    def written(self) -> bool:
        """Whether this rank's files are written (or the write failed); local, never blocks."""
        return not self._thread.is_alive()

    def finish(self) -> Path:
        """Wait for this rank's files, then complete the checkpoint once every rank's are written; collective.

        Raises:
            DiskFullError: a writer ran out of space (the ``.tmp`` directory is removed).
        """
        rank = dist.get_rank()
        with save_guard(self.root, self.final, remove_tmp=rank == 0):
            self._thread.join()
            if self._error is not None:
                raise self._error
            for fn in self._request.finalize_fns:  # gathers the write results; rank 0 writes the metadata
                fn()
            complete_checkpoint(self.root, self.final, self.step, self._config)
        if rank == 0:
            rotate(self.root, self._keep_last, self.final)
        dist.barrier()
        logger.info("saved checkpoint %s (written in the background)", self.final)
        return self.final


def start_checkpoint(
    root: str | Path,
    state: TrainState,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    config: Any,
    args: Any = None,
) -> PendingSave:
    """Start saving ``state`` as ``root/iter_<step>``: plan and stage now, write in the background; collective.

    The arguments are :func:`~mindspeed_llm.training.checkpoint.save_checkpoint`'s.

    Raises:
        NonFiniteState: some rank's state holds NaN/Inf (nothing is written).
        DiskFullError: the common state did not fit.
    """
    root = Path(root)
    final = check_savable(root, state.step, chunks, optimizer)
    tmp = final.with_name(final.name + ".tmp")
    with save_guard(root, final, remove_tmp=dist.get_rank() == 0):
        request = write_checkpoint(root, final, tmp, state, chunks, optimizer, scheduler, config, args, None, True)
        return PendingSave(_staged(request), root, final, state.step, config, config.checkpoint.keep_last)


def agree_written(pending: PendingSave | None, device: Any = None) -> bool:
    """Whether every rank's files of ``pending`` are written (the same answer everywhere); collective when a
    save is in flight (every rank has one then: saves start at the same steps everywhere)."""
    if pending is None:
        return False
    if dist.get_world_size() == 1:
        return pending.written()
    flag = torch.tensor([int(pending.written())], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
