"""The model tensors of a torch DCP checkpoint, read a batch at a time, and written.

A training checkpoint (``SAVE/step_00000010``) holds ``model.<module name>`` (the model's state
dict, sharded as trained) and ``optim.*``; only the ``model.`` entries are read, and the moving
averages of a ``train.ema`` run (``optim.state.<name>.ema``) in their place by default. DCP reads any
subset of the tensors a checkpoint holds into full (unsharded) tensors without a process group,
so a conversion reads a few hundred megabytes at a time (:meth:`DCPModel.batches`) rather than
the whole model. Writing is one ``dcp.save`` of the ``model`` entries (no optimizer state; the
layout of the ``model`` part of a training checkpoint) that reads each tensor as it writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mindspeed.checkpointing.trust import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from mindspeed_mm.trainer.checkpoint import newest_checkpoint

#: The prefix of the model's entries in a training checkpoint.
MODEL = "model."
#: The prefix of the optimizer's per-parameter state, and the suffix of EMA-AdamW's moving average.
OPTIM_STATE, EMA_SUFFIX = "optim.state.", ".ema"
#: Bytes read per ``dcp.load`` call.
BATCH_BYTES = 64 * 2**20


def resolve_checkpoint(path: str | Path) -> Path:
    """A DCP checkpoint directory: ``path`` itself, or the newest complete ``step_*`` in it.

    Raises:
        ValueError: neither holds a DCP checkpoint.
    """
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    newest = newest_checkpoint(path)
    if newest is not None and (newest / ".metadata").is_file():
        return newest
    raise ValueError(
        f"--load-dir {path} is not a DCP checkpoint (no .metadata) and holds no complete step_* "
        "checkpoint; give a checkpoint directory such as SAVE/step_00000010, or SAVE"
    )


class DCPModel:
    """The ``model.`` tensors of a DCP checkpoint.

    A checkpoint of a ``train.ema`` run also holds the moving average of every trained parameter
    (``optim.state.<name>.ema``, EMA-AdamW's state); with ``ema`` (the default) those are the
    values read for the parameters that have one (:attr:`ema_names`), the frozen ones keep theirs.

    Args:
        path: the checkpoint directory (or a ``checkpoint.save`` folder: its newest checkpoint).
        ema: read the moving averages where the checkpoint holds them; false: the raw trained weights.

    Raises:
        ValueError: not a DCP checkpoint, unreadable metadata, or no model tensors.
    """

    def __init__(self, path: str | Path, ema: bool = True) -> None:
        self.path = resolve_checkpoint(path)
        metadata = read_dcp_metadata(self.path)  # one line for a damaged or refused (code-running) .metadata
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            fqn[len(MODEL) :]: (entry.properties.dtype, tuple(entry.size))
            for fqn, entry in metadata.state_dict_metadata.items()
            if fqn.startswith(MODEL) and isinstance(entry, TensorStorageMetadata)
        }
        if not self.tensors:
            raise ValueError(f"{self.path} holds no model tensors (model.*); is it a mindspeed-mm training checkpoint?")
        averages = {
            fqn[len(OPTIM_STATE) : -len(EMA_SUFFIX)]
            for fqn, entry in metadata.state_dict_metadata.items()
            if fqn.startswith(OPTIM_STATE) and fqn.endswith(EMA_SUFFIX) and isinstance(entry, TensorStorageMetadata)
        }
        #: parameter name -> the fqn of its moving average (only with ``ema``).
        self.ema_names: dict[str, str] = (
            {name: f"{OPTIM_STATE}{name}{EMA_SUFFIX}" for name in averages if name in self.tensors} if ema else {}
        )
        #: the checkpoint holds moving averages (whether read or not).
        self.has_ema = bool(averages)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full tensors ``names`` (module names).

        Raises:
            ValueError: the data files are missing or damaged.
        """
        keys = {name: self.ema_names.get(name, MODEL + name) for name in names}
        state = {keys[name]: torch.empty(self.tensors[name][1], dtype=self.tensors[name][0]) for name in names}
        try:
            dcp.load(
                state, storage_reader=SafeFileSystemReader(str(self.path)), planner=SafeLoadPlanner(), no_dist=True
            )
        except (Exception, CheckpointException) as err:  # a BaseException whose text is a traceback: one line
            failures = getattr(err, "failures", None) or {}
            inner = next(iter(failures.values()), err)
            inner = inner[0] if isinstance(inner, tuple) else inner
            raise ValueError(
                f"{self.path}: reading {names[0]} failed ({type(inner).__name__}); the checkpoint is "
                "incomplete or damaged"
            ) from None
        return {name: state[keys[name]] for name in names}

    def batches(self, names: list[str], budget: int = BATCH_BYTES) -> Iterator[dict[str, torch.Tensor]]:
        """``names`` read in order, a batch of at most ``budget`` bytes (or one tensor) at a time."""
        batch: list[str] = []
        size = 0
        for name in names:
            dtype, shape = self.tensors[name]
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            if batch and size + nbytes > budget:
                yield self.read(batch)
                batch, size = [], 0
            batch.append(name)
            size += nbytes
        if batch:
            yield self.read(batch)


def write_dcp(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], read: Callable[[str], torch.Tensor], directory: Path
) -> None:
    """Write tensors ``specs`` (module name -> dtype, shape) as the ``model`` entries of a DCP checkpoint.

    DCP plans from the specs (meta tensors) and asks for each tensor's data only when it writes
    it (:class:`_LazySavePlanner`), so one source tensor is in memory at a time.
    """
    state = {"model": {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape) in specs.items()}}
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(str(directory), thread_count=1),
        planner=_LazySavePlanner(read),
        no_dist=True,
    )


class _LazySavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a tensor's data is read when DCP writes it."""

    def __init__(self, read: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self.read = read

    def resolve_data(self, write_item: Any) -> torch.Tensor:
        return self.read(write_item.index.fqn[len(MODEL) :]).contiguous()
