"""Reading "mllm_format" files (LLaMA-Factory / MindSpeed-MM) and rejecting malformed samples.

A sample is ``{"messages": [{"role": "user", "content": "<image>What is it?"},
{"role": "assistant", "content": "A cat."}], "images": ["cat.jpg"]}``: one ``<image>``
placeholder per entry of ``images`` and one ``<video>`` placeholder per entry of ``videos`` (a
video file, a folder of frame images, or a list of frame image paths), paths relative to
``data.image_dir`` or the file's folder; one ``<audio>`` placeholder per entry of ``audios`` (a
.wav file, for families that take audio: Qwen2.5-Omni); samples without media are allowed. A ``.jsonl`` file holds one sample a line, a
``.json`` file a list of samples. Every problem is a ``ValueError`` naming the file, the line
(or the list item) and the fix; nothing is decoded here, so checking a large set is cheap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class MllmSample:
    """One checked sample.

    Attributes:
        messages: ``[{"role", "content"}, ...]`` with ``<image>`` / ``<video>`` placeholders in the contents.
        images: absolute image paths, in placeholder order.
        source: ``file:line`` (or ``file[item]``) it came from, for error messages.
        videos: per video, in placeholder order: an absolute video file path, a frame folder's
            path, or a tuple of absolute frame image paths.
        audios: absolute audio (.wav) paths, in placeholder order.
    """

    messages: tuple[dict[str, str], ...]
    images: tuple[str, ...]
    source: str
    videos: tuple[str | tuple[str, ...], ...] = ()
    audios: tuple[str, ...] = ()


def read_mllm_files(
    files: list[str], image_dir: str | None = None, max_samples: int | None = None, require_answer: bool = True
) -> list[MllmSample]:
    """Read and check every sample of ``files`` (in order).

    ``require_answer=False`` accepts samples without an assistant turn (prompts for ``generate``).

    Raises:
        ValueError: naming the file, the line and the fix of the first malformed sample.
    """
    samples: list[MllmSample] = []
    for name in files:
        path = Path(name)
        base = Path(image_dir) if image_dir else path.resolve().parent
        for where, record in _records(path):
            samples.append(_check(record, where, base, require_answer))
            if max_samples is not None and len(samples) >= max_samples:
                return samples
    if not samples:
        raise ValueError(f"data.files {', '.join(files)} hold no samples; add mllm_format records")
    return samples


def _records(path: Path) -> list[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{err.lineno}: not valid JSON ({err.msg}); a .json data file holds one list of samples"
            ) from err
        return [(f"{path}[{i}]", item) for i, item in enumerate(items)]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}); write one sample object per line") from err
    return records


def _check(record: Any, where: str, base: Path, require_answer: bool = True) -> MllmSample:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: a sample must be an object with `messages` (and `images` / `videos`), got {type(record).__name__}"
        )
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: `messages` is missing or empty; give a list of {{"role", "content"}} turns')
    checked = []
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f'{where}: messages[{i}] must be {{"role": one of {", ".join(ROLES)}, "content": '
                f"a string}}, got {message!r}"
            )
        checked.append({"role": message["role"], "content": message["content"]})
    if require_answer and not any(m["role"] == "assistant" for m in checked):
        raise ValueError(f"{where}: no assistant turn; a training sample needs at least one answer")
    images = _media_list(record, "images", where)
    videos = _media_list(record, "videos", where)
    audios = _media_list(record, "audios", where)
    for placeholder, key, listed in (
        (IMAGE_PLACEHOLDER, "images", images),
        (VIDEO_PLACEHOLDER, "videos", videos),
        (AUDIO_PLACEHOLDER, "audios", audios),
    ):
        placeholders = sum(m["content"].count(placeholder) for m in checked)
        if placeholders != len(listed):
            noun = key[:-1]
            fix = (
                f"add {placeholder} to the messages"
                if placeholders < len(listed)
                else f"add the {noun} paths to `{key}`"
            )
            raise ValueError(
                f"{where}: {placeholders} {placeholder} placeholder(s) but {len(listed)} {noun}(s); {fix} so "
                f"each {noun} has one placeholder"
            )
    resolved = [_resolve(image, base, where, "image") for image in images]
    clips: list[str | tuple[str, ...]] = []
    for video in videos:
        if isinstance(video, list):
            if not video:
                raise ValueError(f"{where}: a video given as a frame list is empty; list its frame images")
            clips.append(tuple(_resolve(frame, base, where, "video frame") for frame in video))
        else:
            clips.append(_resolve(video, base, where, "video", folder_ok=True))
    sounds = tuple(_resolve(audio, base, where, "audio") for audio in audios)
    return MllmSample(messages=tuple(checked), images=tuple(resolved), source=where, videos=tuple(clips), audios=sounds)


def _media_list(record: dict, key: str, where: str) -> list:
    """``record[key]`` as a list: paths (``images``), or paths and lists of frame paths (``videos``)."""
    items = record.get(key) or []
    if isinstance(items, str):
        items = [items]
    nested_ok = key == "videos"
    if not isinstance(items, list) or not all(
        isinstance(p, str) or (nested_ok and isinstance(p, list) and all(isinstance(f, str) for f in p)) for p in items
    ):
        shape = "paths (a video: a file, a frame folder, or a list of frame paths)" if nested_ok else "paths"
        raise ValueError(f"{where}: `{key}` must be a list of {shape}, got {items!r}")
    return items


def _resolve(name: str, base: Path, where: str, what: str, folder_ok: bool = False) -> str:
    path = Path(name) if Path(name).is_absolute() else base / name
    if not (path.is_file() or (folder_ok and path.is_dir())):
        raise ValueError(
            f"{where}: {what} {name!r} not found (looked for {path}); fix the path or set "
            "data.image_dir to the folder the paths are relative to"
        )
    return str(path)
