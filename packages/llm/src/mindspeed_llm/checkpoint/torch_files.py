"""``torch.save`` files written tensor by tensor, and read lazily without unpickling code.

A ``torch.save`` file is a zip archive: ``data.pkl`` (the object, with every tensor storage
replaced by a persistent id) and one record ``data/<key>`` per storage. Nothing requires the
pickle to be written first, so :class:`StreamingTorchWriter` appends each tensor's bytes as soon
as the tensor exists and writes the pickle last: a Megatron rank file is produced with one
tensor in memory at a time, and ``torch.load`` reads it like any other.

:class:`LazyTorchFile` is the reverse: it unpickles ``data.pkl`` with an allow-list (tensors,
containers, ``argparse.Namespace``, dtypes); every other class becomes an inert placeholder, so
no code from the file runs; tensors stay on disk as :class:`LazyTensor` until ``load()``.
"""

from __future__ import annotations

import argparse
import builtins
import collections
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.checkpointing.block_io import map_file_range, pwrite_all, write_blocks
from mindspeed.checkpointing.blocks import Blocks

#: dtype -> name of its legacy typed-storage class (``FloatStorage`` ...), the tag torch.save pickles.
_STORAGE_NAMES = {dtype: name for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
_STORAGE_DTYPES = {name: dtype for dtype, name in _STORAGE_NAMES.items()}
_DTYPE_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in _STORAGE_NAMES}


class _StoragePid:
    """Stands for one written storage in the pickle (turned into a persistent id)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class StoredTensor:
    """A tensor already written to a :class:`StreamingTorchWriter`; pickles as that tensor."""

    def __init__(self, pid: _StoragePid, shape: tuple[int, ...]) -> None:
        self.pid, self.shape = pid, tuple(shape)

    def __reduce__(self):
        stride, step = [], 1
        for size in reversed(self.shape):
            stride.insert(0, step)
            step *= max(size, 1)
        return torch._utils._rebuild_tensor_v2, (
            self.pid,
            0,
            self.shape,
            tuple(stride),
            False,
            collections.OrderedDict(),
        )


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StoragePid):
            # The same tuple torch.save writes: ("storage", typed-storage class, key, location, numel).
            return "storage", getattr(torch, _STORAGE_NAMES[obj.dtype]), obj.key, "cpu", obj.numel
        return None


class _FileSink:
    """The file object :class:`StreamingTorchWriter` gives torch's zip writer.

    torch writes every header through :meth:`write`; for a record announced with
    ``write_record_metadata`` it skips the data with a relative :meth:`seek`, which tells us
    where that record's bytes go (:attr:`hole`); we write them there ourselves.
    """

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.position = 0
        self.hole = -1

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.fd < 0:
            # Closed after a failure: torch's writer still finishes the archive when it is freed
            # (an exception there would abort the process); the file is being removed anyway.
            return len(view)
        # The view is into torch's memory and only valid during this call: write it now.
        written = pwrite_all(self.fd, [view], self.position)
        self.position += written
        return written

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != os.SEEK_CUR:
            raise OSError("the zip writer is expected to skip forward only")
        self.hole = self.position
        self.position += offset
        return self.position

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class StreamingTorchWriter:
    """Write a ``torch.save``-compatible file one tensor at a time.

    Usage: ``ref = writer.add(tensor)`` for each tensor (its bytes go to disk now), then
    ``writer.close(obj)`` where ``obj`` holds the refs in place of the tensors. torch's own zip
    writer lays out the archive (headers, 64-byte aligned records, central directory); the
    tensor bytes are written by :func:`~mindspeed.checkpointing.block_io.write_blocks` into the
    record's place, straight from the views a tensor is made of.

    Args:
        path: the file to create.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = _FileSink(self.path)
        # No CRC32 (torch.save's ``config.save.compute_crc32 = False``): torch.load does not check it,
        # and computing it costs as much as writing to the page cache.
        self._zip = torch._C.PyTorchFileWriter(self._file, False, 64)
        self._count = 0
        self.bytes_written = 0

    def add(self, tensor: torch.Tensor | Blocks) -> StoredTensor:
        """Write ``tensor``'s data; returns the reference to put in the object passed to :meth:`close`."""
        data = tensor if isinstance(tensor, Blocks) else Blocks.of(tensor.detach().cpu())
        key = str(self._count)
        self._count += 1
        self._file.hole = -1
        self._zip.write_record_metadata(f"data/{key}", data.nbytes)
        if data.nbytes:
            if self._file.hole < 0:
                raise RuntimeError("torch's zip writer did not leave room for the record's data")
            write_blocks(self._file.fd, self._file.hole, data)
        self.bytes_written += data.nbytes
        return StoredTensor(_StoragePid(key, data.dtype, data.numel), tuple(data.shape))

    def close(self, obj: Any) -> None:
        """Pickle ``obj`` (refs from :meth:`add` stand for tensors) and finish the archive."""
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump(obj)
        data = buffer.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        for name, value in ((".format_version", "1"), (".storage_alignment", "64"), ("byteorder", "little")):
            self._zip.write_record(name, value, len(value))
        self._zip.write_end_of_file()
        self._file.close()

    def abort(self) -> None:
        """Close the file unfinished (the caller removes it)."""
        self._file.close()
        self._zip = None  # freed now, finishing into the closed file (a no-op)


@dataclass
class LazyTensor:
    """A tensor still on disk in a :class:`LazyTorchFile`.

    Attributes:
        file: the file holding it.
        key: its storage record.
        dtype: element type.
        numel: elements in the storage.
        offset: storage offset of the tensor, in elements.
        shape: tensor shape.
        stride: tensor strides.
    """

    file: LazyTorchFile
    key: str
    dtype: torch.dtype
    numel: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements."""
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize

    def load(self) -> torch.Tensor:
        """The tensor (backed by a private mapping of its record, see :func:`map_file_range`)."""
        return self.file.read(self)

    def read_into(self, out: torch.Tensor, start: int = 0) -> None:
        """Copy elements ``[start, start + out.numel())`` of this (contiguous) tensor into ``out``.

        One kernel copy from the page cache into ``out`` (no intermediate buffer): how
        tensor-parallel pieces are glued into a preallocated full tensor.
        """
        self.file.read_into(self, out, start)


class _Inert:
    """Placeholder for any class outside the allow-list: records its arguments, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def describe(obj: Any) -> str:
    """What an unpickled value is, for an error: a class outside the allow-list is named as pickled."""
    module = type(obj).__module__
    if module.startswith("inert:"):
        return f"a pickled {module[len('inert:') :]}.{type(obj).__name__} (outside the allow-list: not run)"
    return f"a {type(obj).__name__}"


class _StorageTag:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, file: LazyTorchFile) -> None:
        super().__init__(io.BytesIO(data))
        self._file = file

    def persistent_load(self, pid: Any) -> Any:
        kind, storage_type, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        dtype = storage_type.dtype if isinstance(storage_type, _StorageTag) else torch.uint8
        return (key, dtype, numel)

    def _rebuild_tensor(self, storage: Any, offset: int, shape: Any, stride: Any, *_: Any) -> LazyTensor:
        key, dtype, numel = storage
        return LazyTensor(self._file, key, dtype, numel, offset, tuple(shape), tuple(stride))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, *_: data
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("argparse", "Namespace"):
            return argparse.Namespace
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageTag(_STORAGE_DTYPES[name])
        if module == "torch" and name == "UntypedStorage":
            return _StorageTag(torch.uint8)
        if module == "torch" and name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
        if module == "builtins" and name in ("set", "frozenset", "slice", "complex", "range"):
            return getattr(builtins, name)
        return type(name, (_Inert,), {"__module__": f"inert:{module}"})


class LazyTorchFile:
    """A ``torch.save`` file opened without loading its tensors.

    Args:
        path: the file.

    Attributes:
        obj: the unpickled object; tensors in it are :class:`LazyTensor` s.

    Raises:
        ValueError: the file is not a readable ``torch.save`` archive (truncated, say).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._reader = torch._C.PyTorchFileReader(str(self.path))
            data = self._reader.get_record("data.pkl")
        except RuntimeError as err:
            raise ValueError(
                f"{self.path} is not a readable torch checkpoint ({str(err).splitlines()[0]}); "
                "is it truncated? re-create it"
            ) from None
        self.obj = _Unpickler(data, self).load()

    def read_into(self, tensor: LazyTensor, out: torch.Tensor, start: int = 0) -> None:
        """Copy elements ``[start, start + out.numel())`` of ``tensor`` into the contiguous ``out``.

        Raises:
            ValueError: ``tensor`` is not a plain contiguous record, or the file ends early.
        """
        contiguous = torch.empty(tensor.shape, dtype=torch.uint8, device="meta").stride() == tensor.stride
        if not contiguous or out.dtype != tensor.dtype or not out.is_contiguous():
            raise ValueError(f"{self.path}: record {tensor.key} cannot be read in place")
        offset = self._reader.get_record_offset(f"data/{tensor.key}") + (tensor.offset + start) * tensor.dtype.itemsize
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(offset)
            done = 0
            while done < len(view):
                count = handle.readinto(view[done:])
                if not count:
                    raise ValueError(f"{self.path} is truncated: tensor record {tensor.key} ends early")
                done += count

    def read(self, tensor: LazyTensor) -> torch.Tensor:
        """Load one tensor of this file."""
        nbytes = tensor.numel * tensor.dtype.itemsize
        name = f"data/{tensor.key}"
        try:
            offset = self._reader.get_record_offset(name)
        except RuntimeError as err:
            raise ValueError(
                f"{self.path}: cannot read tensor record {tensor.key} ({str(err).splitlines()[0]})"
            ) from None
        if offset + nbytes > self.path.stat().st_size:
            raise ValueError(f"{self.path} is truncated: tensor record {tensor.key} ends past the end of the file")
        # Records are stored uncompressed, so the tensor is a plain byte range of the file.
        storage = map_file_range(self.path, offset, nbytes, tensor.dtype)
        return storage.as_strided(tensor.shape, tensor.stride, tensor.offset)
