"""Directories and files that appear whole or not at all, and the helpers of checkpoint writers.

:func:`atomic_directory` builds a directory under a temporary name next to its target and renames
it onto the target at the end (a failure leaves the target as it was); :func:`copy_assets` copies
a model directory's non-weight files (config, tokenizer ...); :func:`parse_size` reads shard sizes
such as ``5GB``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Files of a Hugging Face directory that are weights (everything else there is config, tokenizer, docs).
WEIGHT_FILE = re.compile(
    r"(\.safetensors|\.bin|\.pt|\.pth|\.gguf|\.msgpack|\.h5|\.safetensors\.index\.json|\.bin\.index\.json)$"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """Bytes of ``"5GB"``, ``"500MiB"``, ``"64KB"`` or a plain integer.

    Args:
        text: the size.
        flag: the option it came from, named in the error.

    Raises:
        ValueError: unreadable size.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{flag} {text!r} is not a size like 5GB, 500MB or 1000000")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``target``; on success it replaces ``target``.

    On an exception the temporary directory is removed and ``target`` is left as it was.
    """
    target = Path(target).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        yield temp
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        target.rename(old)
        temp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        temp.rename(target)


def copy_assets(source: Path | None, destination: Path) -> list[str]:
    """Copy the non-weight top-level files of ``source`` (config, tokenizer ...) into ``destination``."""
    if source is None:
        return []
    destination.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(Path(source).iterdir()):
        if path.is_file() and not WEIGHT_FILE.search(path.name):
            shutil.copy2(path, destination / path.name)
            copied.append(path.name)
    return copied
