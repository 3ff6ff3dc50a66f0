"""Hugging Face safetensors checkpoints, read tensor by tensor and written as tensors arrive.

Reading: :class:`HFCheckpoint` parses the index and every shard's header up front (so a missing
or truncated shard fails before any work) and maps one tensor's bytes at a time. Mapping whole
shards (``safe_open``) would keep every page touched resident until the shard is closed, so
converting a model would count the whole model against the process's memory; a mapping per
tensor is unmapped with the tensor, so only the tensors in flight are resident.

Writing: :class:`SafetensorsShardWriter` knows every tensor's name, dtype and shape in advance
(from the conversion plan), so it writes each shard's header first and then each tensor at its
offset the moment it is produced, in any order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mindspeed.checkpointing.block_io import map_file_range, write_blocks
from mindspeed.checkpointing.blocks import Blocks

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lies in a shard.

    Attributes:
        file: the shard.
        dtype: element type.
        shape: tensor shape.
        start: absolute byte offset of the data in the file.
        nbytes: data length.
    """

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, checked against the file's length.

    Raises:
        ValueError: missing, unreadable, or shorter than its header promises (truncated).
    """
    if not path.is_file():
        raise ValueError(f"shard {path} does not exist")
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError(f"shard {path} is truncated ({size} bytes); re-download it")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise ValueError(
                f"shard {path} is truncated: its header needs {8 + length} bytes, the file has {size}; re-download it"
            )
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"shard {path} has no valid safetensors header; is it a safetensors file?") from None
    base = 8 + length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"shard {path}: tensor {name} has unsupported dtype {entry['dtype']}")
        out[name] = TensorInfo(path, _DTYPES[entry["dtype"]], tuple(entry["shape"]), base + begin, end - begin)
    end = max((info.start + info.nbytes for info in out.values()), default=base)
    if end > size:
        raise ValueError(
            f"shard {path} is truncated: its tensors need {end} bytes, the file has {size}; re-download it"
        )
    return out


class HFCheckpoint:
    """The safetensors weights of a Hugging Face checkpoint directory.

    Args:
        path: the directory (``model.safetensors.index.json`` + shards, or one ``model.safetensors``).
        stem: the files' name stem (``diffusion_pytorch_model`` for a diffusers model: its
            ``diffusion_pytorch_model.safetensors[.index.json]``).

    Raises:
        ValueError: no safetensors weights, an index naming a missing shard or a tensor its shard
            lacks, or a truncated shard.
    """

    def __init__(self, path: str | Path, stem: str = "model") -> None:
        self.path = Path(path)
        index_name, single_name = f"{stem}.safetensors.index.json", f"{stem}.safetensors"
        index = self.path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            headers = {}
            for file in sorted(set(weight_map.values())):
                if not (self.path / file).is_file():
                    raise ValueError(
                        f"{index} points at {file}, which is not in {self.path}; re-download the shard or fix the index"
                    )
                headers[file] = read_header(self.path / file)
            self.tensors = {}
            for name, file in weight_map.items():
                if name not in headers[file]:
                    raise ValueError(f"{index} places {name} in {file}, but that shard does not hold it")
                self.tensors[name] = headers[file][name]
        elif (self.path / single_name).is_file():
            self.tensors = read_header(self.path / single_name)
        else:
            raise ValueError(
                f"{self.path} holds no safetensors weights ({index_name} or {single_name}); "
                "save the model with safetensors first"
            )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape."""
        return {name: info.shape for name, info in self.tensors.items()}

    def read(self, name: str) -> torch.Tensor:
        """One tensor, mapped from its shard (a private mapping of just its bytes, freed with it)."""
        info = self.tensors[name]
        return map_file_range(info.file, info.start, info.nbytes, info.dtype).reshape(info.shape)

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors."""
        return sum(info.nbytes for info in self.tensors.values())


@dataclass
class _Shard:
    path: Path
    offsets: dict[str, tuple[int, int]]
    remaining: set[str]
    handle: object | None = None


class SafetensorsShardWriter:
    """Write a sharded Hugging Face checkpoint whose tensors are known in advance.

    Tensors are assigned to shards in the given order, each shard filled up to ``max_shard_bytes``;
    the index ``model.safetensors.index.json`` is always written (unless ``single`` and one shard).

    Args:
        path: the output directory.
        tensors: ``(name, dtype, shape)`` of every tensor, in the order they should be laid out.
        max_shard_bytes: shard size limit (a tensor larger than it gets a shard of its own).
        stem: the files' name stem (``model``; ``diffusion_pytorch_model`` for a diffusers model).
        single: with one shard, write ``{stem}.safetensors`` and no index (as ``save_pretrained`` does).
    """

    def __init__(
        self,
        path: str | Path,
        tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
        max_shard_bytes: int,
        stem: str = "model",
        single: bool = False,
    ) -> None:
        self.path = Path(path)
        self.stem = stem
        groups: list[list[tuple[str, torch.dtype, tuple[int, ...], int]]] = [[]]
        size = 0
        for name, dtype, shape in tensors:
            nbytes = dtype.itemsize
            for dim in shape:
                nbytes *= dim
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, dtype, tuple(shape), nbytes))
            size += nbytes
        self.total_bytes = 0
        self.shards: list[_Shard] = []
        self.where: dict[str, _Shard] = {}
        self.single = single and len(groups) == 1
        for number, group in enumerate(groups, 1):
            name = f"{stem}.safetensors" if self.single else f"{stem}-{number:05d}-of-{len(groups):05d}.safetensors"
            shard = self._create(self.path / name, group)
            self.shards.append(shard)
            self.where.update({name: shard for name, *_ in group})

    def _create(self, path: Path, group: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> _Shard:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape, nbytes in group:
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        base = 8 + len(raw)
        handle = path.open("wb")
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(base + offset)
        self.total_bytes += offset
        offsets = {name: (base + header[name]["data_offsets"][0], nbytes) for name, _, _, nbytes in group}
        return _Shard(path, offsets, set(offsets), handle)

    def write(self, name: str, tensor: torch.Tensor | Blocks) -> bool:
        """Write one planned tensor (or the views it is made of, see
        :func:`~mindspeed.checkpointing.block_io.write_blocks`); returns True when this
        completed (and closed) its shard.

        Raises:
            ValueError: ``name`` was not planned, was written twice, or has another byte size.
        """
        shard = self.where.get(name)
        if shard is None or name not in shard.remaining:
            raise ValueError(f"{name} is not a pending tensor of this checkpoint")
        start, nbytes = shard.offsets[name]
        data = tensor if isinstance(tensor, Blocks) else Blocks.of(tensor.detach().cpu())
        if data.nbytes != nbytes:
            raise ValueError(f"{name}: {data.nbytes} bytes, planned {nbytes}")
        write_blocks(shard.handle.fileno(), start, data)
        shard.remaining.discard(name)
        if not shard.remaining:
            shard.handle.close()
            shard.handle = None
            return True
        return False

    def finish(self) -> None:
        """Write the index; every planned tensor must have been written."""
        pending = [name for shard in self.shards for name in shard.remaining]
        if pending:
            raise ValueError(f"{len(pending)} planned tensors were never written, e.g. {pending[0]}")
        if self.single:
            return
        weight_map = {name: shard.path.name for name, shard in self.where.items()}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.path / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        """Close every open shard (the caller removes the directory)."""
        for shard in self.shards:
            if shard.handle is not None:
                shard.handle.close()
                shard.handle = None
