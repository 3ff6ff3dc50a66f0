"""Files from a checkpoint directory are read without running code from them.

A checkpoint may come from elsewhere (a colleague, a download), so nothing read from one may
execute code. Three kinds of file are pickles:

- torch DCP's ``.metadata``: torch's ``FileSystemReader`` reads it with plain ``pickle.load``.
  :func:`read_dcp_metadata` unpickles it with :class:`MetadataUnpickler`, which resolves only the
  classes DCP metadata is made of (:data:`DCP_METADATA_GLOBALS`, torch dtypes, ``torch.Size``);
  any other class is refused with one line naming the file and the class, before anything is
  constructed. :class:`SafeFileSystemReader` is a ``FileSystemReader`` that reads it so.
- non-tensor values inside DCP's data files (``BytesIO`` items: optimizer hyper-parameters,
  megatron's sharded objects): DCP's ``DefaultLoadPlanner.load_bytes`` loads them with
  ``torch.load`` with weights-only loading off; :class:`SafeLoadPlanner` loads them weights-only.
- ``torch.save`` files (megatron's ``common.pt``, older trainer states): :func:`load_torch_file`
  loads them with ``weights_only=True`` and turns a refusal into one line.

megatron-core's ``dist_checkpointing.load`` builds its own reader and planner, so its loads run
inside :func:`weights_only_loads` (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``: every ``torch.load``
in the process is weights-only, even one that turns it off); the LLM trainer
also gives megatron a :class:`SafeFileSystemReader` (a version-checked patch) and checks the
directory with :func:`check_dcp_checkpoint` first, for a one-line error. See docs/reliability.md
("Trust").
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from mindspeed.config import ConfigError

#: The DCP metadata file of a checkpoint directory.
DCP_METADATA = ".metadata"

#: ``module -> names``: the classes a DCP ``.metadata`` pickle is made of (torch's own metadata,
#: the planner's items megatron-core records in ``all_local_plans``, the checkpoint id's path).
DCP_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.planner": frozenset(
        {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType"}
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a name -> one of torch's layouts, nothing else
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex", "bytearray"}),
}

_TRUST_HINT = "a checkpoint runs no code; use one written by torch.distributed.checkpoint or megatron-core"


class UntrustedFileError(ConfigError):
    """A checkpoint file holds something that loading would have to execute: refused, nothing run."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, resolving only :data:`DCP_METADATA_GLOBALS` and torch dtypes.

    Args:
        file: the open pickle.
        path: the file's name, for the error.
    """

    def __init__(self, file: Any, path: str | Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        """The allowed class ``module.name``; anything else raises :class:`UntrustedFileError`."""
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedFileError(
            f"checkpoint file {self.path} holds a pickled {module}.{name}, which DCP metadata never "
            f"holds: refused without running it ({_TRUST_HINT})"
        )

    def persistent_load(self, pid: Any) -> Any:
        """DCP metadata has no persistent ids."""
        raise pickle.UnpicklingError("persistent id in DCP metadata")


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of ``path`` (a checkpoint directory or its ``.metadata`` file), read without running code.

    Raises:
        UntrustedFileError: the file holds a class DCP metadata is not made of (one line).
        ConfigError: the file is missing or is no DCP metadata (damaged).
    """
    path = Path(path)
    file = path / DCP_METADATA if path.is_dir() else path
    try:
        with open(file, "rb") as handle:
            metadata = MetadataUnpickler(handle, file).load()
    except UntrustedFileError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"{file.parent} is no DCP checkpoint: it has no {DCP_METADATA}") from None
    except Exception as err:  # truncated, garbage: the unpickler's many error types
        raise ConfigError(
            f"checkpoint file {file} is unreadable ({type(err).__name__}); the checkpoint is damaged"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"checkpoint file {file} holds a {type(metadata).__name__}, not DCP metadata; it is damaged")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` is read by :class:`MetadataUnpickler`.

    The metadata is read once and kept (as megatron-core's ``CachedMetadataFileSystemReader``).
    """

    _cached: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        """As torch's; another checkpoint forgets the kept metadata."""
        super().reset(checkpoint_id)
        if checkpoint_id is not None:
            self._cached = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (the global file; a rank's ``__N.metadata`` when asked by rank)."""
        rank = kwargs.get("rank")
        if rank is not None or self._cached is None:
            metadata = read_dcp_metadata(Path(self._get_metadata_path(rank)))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            if rank is not None:
                return metadata
            self._cached = metadata
        self._cached.storage_meta.load_id = self.load_id  # reset() may have changed it since
        return self._cached


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Place the value of ``read_item`` (a ``torch.save`` record) into the state dict."""
        loaded = load_torch_file(value, name=f"entry {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_torch_file(source: str | Path | io.BytesIO, name: str | None = None, **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True)``; a refused class is one line naming the file.

    Args:
        source: the file (or an in-memory record).
        name: how to call it in the error (default: the path).
        **kwargs: passed to ``torch.load`` (``map_location``, ``mmap``).

    Raises:
        UntrustedFileError: the file holds a class torch's weights-only unpickler refuses.
        ConfigError: the file is missing, truncated or no ``torch.save`` file.
    """
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f"it holds a pickled {found.group(1)}" if found else f"{type(err).__name__}"
        raise UntrustedFileError(
            f"checkpoint file {name or source} was refused by torch's weights-only loader ({what}); {_TRUST_HINT}"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as err:  # not a torch.save file, truncated
        raise ConfigError(
            f"checkpoint file {name or source} is unreadable ({type(err).__name__}); the checkpoint is damaged"
        ) from None


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every ``torch.load`` inside is weights-only, even one that turns weights-only loading off.

    For upstream code that loads checkpoint files itself (megatron-core's ``dist_checkpointing``,
    DCP's default planner). Sets torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` and clears
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` for the duration, then restores both.
    """
    names = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {name: os.environ.get(name) for name in names}
    os.environ[names[0]] = "1"
    os.environ.pop(names[1], None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_dcp_checkpoint(directory: str | Path, common: str | None = None) -> Metadata:
    """Read a DCP checkpoint's metadata (and ``common``, a ``torch.save`` file in it) without running code.

    Run before handing ``directory`` to a loader that reads it itself, for a one-line error.

    Returns:
        The metadata.

    Raises:
        UntrustedFileError: a file holds something loading would execute.
    """
    metadata = read_dcp_metadata(directory)
    if common is not None and (Path(directory) / common).is_file():
        load_torch_file(Path(directory) / common, map_location="cpu")
    return metadata


__all__ = [
    "DCP_METADATA",
    "DCP_METADATA_GLOBALS",
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UntrustedFileError",
    "check_dcp_checkpoint",
    "load_torch_file",
    "read_dcp_metadata",
    "weights_only_loads",
]
