"""VQA evaluation data: MMBench-style TSV files and JSON / JSONL files with image paths.

**MMBench TSV** (the format of MMBench, CCBench, SEED-Bench and the other multiple-choice sets
VLMEvalKit distributes): a header row, then one question a row, tab separated, columns

- ``index``: the question's id;
- ``question``; ``hint`` (optional, may be empty);
- ``A``, ``B``, ``C``, ``D`` (``E`` ... ``I`` optional): the options; an empty cell means no such option;
- ``answer``: the right option's letter;
- ``image``: the image as base64 (PNG/JPEG bytes); a cell that holds another row's ``index``
  reuses that row's image (as VLMEvalKit's TSVs do for repeated images);
- ``category`` (optional): accuracy is also reported per category (or ``l2-category``).

**JSON / JSONL**: a list of objects (``.json``) or one object a line (``.jsonl``), each with
``question``, ``answer``, ``image`` (a path) or ``images`` (paths), ``video`` (one video) or
``videos`` (a list; a video is a file, a folder of frame images, or a list of frame paths, as in
training data), ``audio`` / ``audios`` (.wav clips, Qwen2.5-Omni; paths relative to the file's folder or ``--image-dir``), and optionally
``options`` (a list, lettered A, B, ... in order, or an object letter -> text; then ``answer`` is
a letter or an option's text: multiple choice; without options: short answer, ``answer`` a
string or a list of accepted strings), ``hint``, ``category``, ``index``. An mllm_format sample
(``messages`` + ``images`` / ``videos`` / ``audios``, the training format) is a short-answer item: the last
user turn is the question, the last assistant turn the answer.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import os
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindspeed_mm.data.mllm import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

#: Option letters in the order MMBench uses them.
LETTERS = tuple(string.ascii_uppercase[:9])
_TSV_REQUIRED = ("index", "question", "A", "B", "answer", "image")


@dataclass(frozen=True)
class VQAItem:
    """One question.

    Attributes:
        index: its id in the file.
        question: the question text (``<image>`` / ``<video>`` placeholders where the images and
            videos go, else none).
        images: image paths.
        options: letter -> option text (empty: a short-answer question).
        answers: the right letter (multiple choice), or the accepted answers (short answer).
        hint: context shown before the question (MMBench's ``hint``).
        category: the group it is counted in ("" for none).
        source: ``file:line`` for messages.
        videos: videos (a file or a frame folder, or a tuple of frame paths), in placeholder order.
        audios: audio clips (.wav), in placeholder order.
    """

    index: str
    question: str
    images: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)
    answers: tuple[str, ...] = ()
    hint: str = ""
    category: str = ""
    source: str = ""
    videos: tuple[str | tuple[str, ...], ...] = ()
    audios: tuple[str, ...] = ()

    @property
    def multiple_choice(self) -> bool:
        """Whether the item has options."""
        return bool(self.options)


def read_vqa_file(
    path: str | Path, image_store: Path, image_dir: str | None = None, max_samples: int | None = None
) -> list[VQAItem]:
    """The items of a ``.tsv`` (MMBench) or ``.json`` / ``.jsonl`` file.

    Args:
        path: the data file.
        image_store: folder where base64 images of a TSV are written as files.
        image_dir: folder image and video paths of JSON files are relative to (default: the file's folder).
        max_samples: read only the first N items.

    Raises:
        ValueError: a missing file, an unknown suffix, or a malformed record (file, line, fix).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"--task-data-path {str(path)!r} does not exist; give an MMBench-style .tsv or a .json / "
            ".jsonl file (or demo)"
        )
    if path.suffix == ".tsv":
        items = _read_tsv(path, image_store, max_samples)
    elif path.suffix in (".json", ".jsonl"):
        items = _read_json(path, Path(image_dir) if image_dir else path.resolve().parent, max_samples)
    else:
        raise ValueError(
            f"--task-data-path {str(path)!r}: unknown format {path.suffix!r}; give a .tsv (MMBench "
            "columns) or a .json / .jsonl file"
        )
    if not items:
        raise ValueError(f"--task-data-path {str(path)!r} holds no questions")
    return items


def _read_tsv(path: Path, image_store: Path, max_samples: int | None) -> list[VQAItem]:
    csv.field_size_limit(sys.maxsize)  # base64 images are long cells
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    header = list(rows[0]) if rows else []
    missing = [c for c in _TSV_REQUIRED if c not in header]
    if missing:
        raise ValueError(
            f"{path}:1: missing column(s) {', '.join(missing)}; an MMBench TSV has index, question, "
            "(hint,) A, B, C, D, answer, image (base64)(, category)"
        )
    image_of = {row["index"]: row["image"] for row in rows}
    group = "category" if "category" in header else "l2-category" if "l2-category" in header else None
    items = []
    image_store.mkdir(parents=True, exist_ok=True)
    for number, row in enumerate(rows, start=2):
        where = f"{path}:{number}"
        if max_samples is not None and len(items) >= max_samples:
            break
        options = {
            letter: row[letter].strip()
            for letter in LETTERS
            if letter in row and row[letter] is not None and row[letter].strip() not in ("", "nan")
        }
        answer = (row["answer"] or "").strip()
        if len(options) < 2:
            raise ValueError(f"{where}: fewer than 2 options in columns A, B, ...; fill at least A and B")
        if answer not in options:
            raise ValueError(
                f"{where}: the answer must be the letter of a given option ({', '.join(options)}), got {answer!r}"
            )
        data = row["image"] or ""
        if len(data) <= 64 and data in image_of and data != row["index"]:
            data = image_of[data]  # a reference to another row's image
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(
                f"{where}: the image cell is not base64 ({err}); encode the image file's bytes with base64"
            ) from None
        if not raw:
            raise ValueError(f"{where}: the image cell is empty; give the image as base64")
        target = image_store / f"{path.stem}-{number:06d}"
        target.write_bytes(raw)
        hint = (row.get("hint") or "").strip()
        items.append(
            VQAItem(
                index=str(row["index"]),
                question=(row["question"] or "").strip(),
                images=(str(target),),
                options=options,
                answers=(answer,),
                hint="" if hint == "nan" else hint,
                category=(row.get(group) or "") if group else "",
                source=where,
            )
        )
    return items


def _json_records(path: Path) -> list[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{err.lineno}: not valid JSON ({err.msg}); a .json file holds one list of questions"
            ) from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json file holds one list of questions, got {type(records).__name__}")
        return [(f"{path}[{i}]", record) for i, record in enumerate(records)]
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({err.msg}); write one question object per line"
                ) from None
    return out


def _read_json(path: Path, base: Path, max_samples: int | None) -> list[VQAItem]:
    items = []
    for where, record in _json_records(path):
        if max_samples is not None and len(items) >= max_samples:
            break
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a question must be an object with question, answer and image(s)")
        items.append(
            _from_messages(record, where, base, len(items))
            if "messages" in record
            else _from_record(record, where, base, len(items))
        )
    return items


def _images(record: dict[str, Any], where: str, base: Path) -> tuple[str, ...]:
    images = record.get("images", record.get("image", []))
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise ValueError(f"{where}: `image` must be a path or `images` a list of paths, got {images!r}")
    return tuple(_resolve(image, base, where, "image") for image in images)


def _videos(record: dict[str, Any], where: str, base: Path) -> tuple[str | tuple[str, ...], ...]:
    """``video`` (one video) or ``videos`` (a list); a video is a file, a frame folder, or a list of frame paths."""
    videos = record["videos"] if "videos" in record else [record["video"]] if "video" in record else []
    videos = [videos] if isinstance(videos, str) else videos
    if not isinstance(videos, list) or not all(
        isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(f, str) for f in v)) for v in videos
    ):
        raise ValueError(
            f"{where}: `video` must be a path (a video file or a frame folder) or a list of frame paths, and "
            f"`videos` a list of those, got {videos!r}"
        )
    return tuple(
        _resolve(video, base, where, "video", folder_ok=True)
        if isinstance(video, str)
        else tuple(_resolve(frame, base, where, "video frame") for frame in video)
        for video in videos
    )


def _audios(record: dict[str, Any], where: str, base: Path) -> tuple[str, ...]:
    audios = record.get("audios", record.get("audio", []))
    audios = [audios] if isinstance(audios, str) else audios
    if not isinstance(audios, list) or not all(isinstance(a, str) for a in audios):
        raise ValueError(f"{where}: `audio` must be a path or `audios` a list of paths, got {audios!r}")
    return tuple(_resolve(audio, base, where, "audio") for audio in audios)


def _resolve(name: str, base: Path, where: str, what: str, folder_ok: bool = False) -> str:
    full = Path(name) if Path(name).is_absolute() else base / name
    if not (full.is_file() or (folder_ok and full.is_dir())):
        raise ValueError(
            f"{where}: {what} {name!r} not found (looked for {full}); fix the path or pass "
            "--image-dir with the folder the paths are relative to"
        )
    return str(full)


def _check_placeholders(text: str, images: tuple, videos: tuple, where: str, always: bool, audios: tuple = ()) -> None:
    """One placeholder per image (video, audio) where the text has any (``always``: also where it has none)."""
    for placeholder, media, noun in (
        (IMAGE_PLACEHOLDER, images, "image"),
        (VIDEO_PLACEHOLDER, videos, "video"),
        (AUDIO_PLACEHOLDER, audios, "audio"),
    ):
        count = text.count(placeholder)
        if (count or always) and count != len(media):
            raise ValueError(
                f"{where}: {count} {placeholder} placeholder(s) in the question but {len(media)} {noun}(s); "
                f"give one {noun} per placeholder"
                + ("" if always else f" (or no {placeholder}: the {noun}s then go before the question)")
            )


def _from_record(record: dict[str, Any], where: str, base: Path, position: int) -> VQAItem:
    question, answer = record.get("question"), record.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: `question` is missing or empty; give the question text")
    options = record.get("options", record.get("choices"))
    if isinstance(options, list):
        if len(options) > len(LETTERS):
            raise ValueError(f"{where}: {len(options)} options; at most {len(LETTERS)} are lettered")
        options = dict(zip(LETTERS, (str(o) for o in options)))
    elif isinstance(options, dict):
        options = {str(k).strip().upper(): str(v) for k, v in options.items()}
    elif options is not None:
        raise ValueError(f"{where}: `options` must be a list of texts or an object letter -> text")
    images, videos, audios = _images(record, where, base), _videos(record, where, base), _audios(record, where, base)
    _check_placeholders(question, images, videos, where, always=False, audios=audios)
    common = {
        "index": str(record.get("index", record.get("id", position))),
        "question": question.strip(),
        "images": images,
        "videos": videos,
        "audios": audios,
        "hint": str(record.get("hint") or ""),
        "category": str(record.get("category") or ""),
        "source": where,
    }
    if options:
        by_text = {text: letter for letter, text in options.items()}
        letter = answer.strip() if isinstance(answer, str) else None
        letter = letter if letter in options else by_text.get(answer) if isinstance(answer, str) else None
        if letter is None:
            raise ValueError(
                f"{where}: `answer` must be an option's letter ({', '.join(options)}) or text, got {answer!r}"
            )
        return VQAItem(options=options, answers=(letter,), **common)
    answers = [answer] if isinstance(answer, str) else answer
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: `answer` must be a string or a list of accepted strings, got {answer!r}")
    return VQAItem(answers=tuple(answers), **common)


def _from_messages(record: dict[str, Any], where: str, base: Path, position: int) -> VQAItem:
    messages = record.get("messages")
    users = (
        [m for m in messages if isinstance(m, dict) and m.get("role") == "user"] if isinstance(messages, list) else []
    )
    if not users or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
        raise ValueError(f"{where}: an mllm_format question needs a user turn followed by the assistant's answer")
    question, answer = str(users[-1].get("content", "")), str(messages[-1].get("content", ""))
    images, videos, audios = _images(record, where, base), _videos(record, where, base), _audios(record, where, base)
    _check_placeholders(question, images, videos, where, always=True, audios=audios)
    return VQAItem(
        index=str(record.get("index", position)),
        question=question,
        images=images,
        videos=videos,
        audios=audios,
        answers=(answer,),
        category=str(record.get("category") or ""),
        source=where,
    )


def encode_image_base64(path: str | Path) -> str:
    """An image file's bytes as base64 (the MMBench ``image`` cell)."""
    return base64.b64encode(Path(path).read_bytes()).decode("ascii")


def write_mmbench_tsv(path: str | Path, rows: list[dict[str, str]]) -> Path:
    """Write ``rows`` (MMBench columns) as a TSV, under a temporary name then renamed."""
    path = Path(path)
    columns = [
        "index",
        "question",
        "hint",
        *[c for c in LETTERS if any(c in r for r in rows)],
        "answer",
        "image",
        "category",
    ]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, delimiter="\t", lineterminator="\n", restval="")
    writer.writeheader()
    writer.writerows(rows)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # per process: two first uses may race
    tmp.write_text(buffer.getvalue(), encoding="utf-8")
    tmp.replace(path)
    return path
