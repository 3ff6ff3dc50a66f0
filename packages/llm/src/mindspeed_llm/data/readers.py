"""Input files to records, each with the place it came from (``file:line`` or ``file row N``).

``--input`` is a file or a directory of jsonl, json, parquet, arrow, csv or txt files, all read
from local disk. JSON Lines (``.jsonl``, and ``.json`` files that do not start with ``[``) are
read line by line here, because ``datasets``' JSON builder names neither the file nor the line
of a malformed record and cannot skip one; every other format goes through ``datasets``'
packaged builders in streaming mode (no cache, no network).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: file extension -> format (``datasets`` builder name, or "jsonl" for the line reader).
FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}
# Written next to the .arrow shards by Dataset.save_to_disk: metadata, not records.
_SAVE_TO_DISK_METADATA = {"state.json", "dataset_info.json"}


@dataclass
class RawRecord:
    """One input record, or the reason it could not be read.

    Attributes:
        location: ``path:line`` (line-based formats) or ``path row N`` (1-based).
        data: the record's columns, or ``None`` when ``error`` is set.
        error: why the record is malformed.
    """

    location: str
    data: dict[str, Any] | None = None
    error: str | None = None


def list_input_files(input_path: str | Path) -> list[Path]:
    """The files ``--input`` names, sorted: the file itself, or a directory's supported files.

    Raises:
        ValueError: the path does not exist, has an unsupported extension, or the directory
            holds no supported file.
    """
    path = Path(input_path).expanduser()
    if not path.exists():
        raise ValueError(
            f"--input {str(path)!r} does not exist; pass a file or a directory of {', '.join(sorted(FORMATS))} files"
        )
    if path.is_file():
        if path.suffix.lower() not in FORMATS:
            raise ValueError(
                f"--input {str(path)!r}: unsupported extension {path.suffix!r} (supported: {', '.join(sorted(FORMATS))})"
            )
        return [path]
    candidates = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    has_arrow = any(p.suffix == ".arrow" for p in candidates)
    files = [
        p for p in candidates if p.suffix.lower() in FORMATS and not (has_arrow and p.name in _SAVE_TO_DISK_METADATA)
    ]
    ignored = [p for p in candidates if p not in files]
    if ignored:
        logger.info(
            "ignoring %d file(s) in %s that are not records: %s",
            len(ignored),
            path,
            ", ".join(str(p.relative_to(path)) for p in ignored[:5]) + (" ..." if len(ignored) > 5 else ""),
        )
    if not files:
        raise ValueError(f"--input directory {str(path)!r} holds no {', '.join(sorted(FORMATS))} file")
    kinds = Counter(FORMATS[p.suffix.lower()] for p in files)
    logger.info(
        "reading %d file(s) from %s (%s)", len(files), path, ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    )
    return files


def describe_json_error(err: json.JSONDecodeError) -> str:
    """``"<problem> at column N"`` (json's own messages of some problems already end in "at")."""
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _read_json_lines(path: Path) -> Iterator[RawRecord]:
    # utf-8-sig: a byte-order mark some editors write is not part of the first record.
    with open(path, encoding="utf-8-sig", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            location = f"{path}:{number}"
            # Without its line break: json would place an error at the end of a cut-short record on
            # the "next line, column 1" of the text it was given; the column must be this line's.
            text = line.rstrip("\r\n")
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                end = ", the end of the line: is the record cut short?" if err.pos >= len(text.rstrip()) else ""
                yield RawRecord(location, error=f"malformed JSON ({describe_json_error(err)}{end})")
                continue
            if not isinstance(data, dict):
                yield RawRecord(location, error=f"expected a JSON object, got {type(data).__name__}")
                continue
            yield RawRecord(location, data)


def _json_error_position(path: Path) -> str:
    """Where a whole-file JSON document breaks, for the error message."""
    try:
        json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        return f"{path}:{err.lineno}: malformed JSON ({describe_json_error(err)})"
    return str(path)


def _read_with_datasets(path: Path, builder: str) -> Iterator[RawRecord]:
    from datasets import load_dataset

    line_based = builder == "text"
    try:
        rows = load_dataset(builder, data_files=str(path), split="train", streaming=True)
        for number, row in enumerate(rows, start=1):
            location = f"{path}:{number}" if line_based else f"{path} row {number}"
            yield RawRecord(location, dict(row))
    except Exception as err:  # noqa: BLE001 -- any reader failure becomes a user error naming the file
        where = _json_error_position(path) if builder == "json" else str(path)
        # Not a RawRecord error: a broken file cannot be resumed after the bad spot.
        raise ValueError(
            f"{where}: cannot be read as {builder} ({type(err).__name__}: {err}); "
            "fix the file (--skip-bad-records cannot skip inside it)"
        ) from err


def iter_records(files: list[Path]) -> Iterator[RawRecord]:
    """Every record of ``files`` in order, malformed ones included as errors."""
    for path in files:
        kind = FORMATS[path.suffix.lower()]
        if kind == "jsonl" or (kind == "json" and not _is_json_array(path)):
            yield from _read_json_lines(path)
        else:
            yield from _read_with_datasets(path, kind)
