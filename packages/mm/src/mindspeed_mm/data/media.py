"""Video/image + caption data for diffusion transformers (MindSpeed-MM's generation data format).

A data file is MindSpeed-MM's video/image JSON (a list of samples), JSON Lines (one sample a
line, the image-caption layout), or MindSpeed-MM's ``data.txt`` (``media folder,data file`` lines)::

    {"path": "videos/x.mp4", "cap": "a red square moves left", "num_frames": 81, "fps": 24,
     "resolution": {"height": 480, "width": 832}}
    {"path": "images/y.png", "cap": "a blue circle"}

``path`` is relative to ``data.image_dir`` (default: the data file's folder); ``cap`` (or
``caption``) is the caption. The listed ``num_frames``, ``fps`` and ``resolution`` describe the
source; the file's own header is what counts (:func:`probe_media`), the listing fills in what a
header lacks. :func:`plan_media` then fixes each sample's target shape from the recipe, so the
buckets are known before anything is decoded:

- frames: the largest of ``data.frame_counts`` that the video fills at ``data.fps`` (frames taken
  every ``source fps / data.fps`` source frames from the first); an image is one frame;
- resolution: the ``data.resolutions`` bucket of the closest aspect ratio (or the source's size
  floored to ``data.hw_stride``), reached by resizing to cover it and cropping the centre.

An image-editing model (Qwen-Image-Edit) trains on (source image, target image, instruction) records: ``path``
is the target, ``cap`` the instruction and ``condition_image`` the source image (relative to the same folder
as ``path``)::

    {"path": "edited/y.png", "cap": "make the circle red", "condition_image": "source/y.png"}

A bad sample (unreadable file, too few frames, no caption, no source image for an editing model) is an error
naming the data file and line, or, with ``data.skip_bad``, left out and counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: File suffixes read as still images (everything else is opened as a video container).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class BadSample(ValueError):
    """A sample that cannot be used; the message names its data file and line."""


@dataclass(frozen=True)
class MediaSample:
    """One listed sample and its target shape.

    Attributes:
        path: the media file.
        caption: its caption.
        where: ``data file:line`` (line: the JSON list's item number for a JSON file, from 1).
        is_image: a still image (one frame).
        frames: source frame indices to take (``[0]`` for an image).
        height: target height. width: target width.
        condition: the source image of an editing record (``condition_image``), or None.
    """

    path: Path
    caption: str
    where: str
    is_image: bool
    frames: tuple[int, ...]
    height: int
    width: int
    condition: Path | None = None

    def key(self) -> tuple[int, int, int]:
        """The bucket: ``(frames, height, width)``."""
        return (len(self.frames), self.height, self.width)


def read_listing(files: list[str], media_dir: str | None) -> list[tuple[dict, Path, str]]:
    """``(record, media path, "file:line")`` of every sample of ``files`` (JSON lists, JSON Lines, or
    MindSpeed-MM's ``data.txt`` of ``media folder,data file`` lines, relative to the .txt's folder).

    Raises:
        ValueError: a file that is neither (naming it), or a record that is not a mapping with ``path``.
    """
    listed = []
    for name in files:
        path = Path(name)
        text = path.read_text()
        if path.suffix == ".txt":  # MindSpeed-MM's data.txt: one `media folder,data file` a line
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                parts = [part.strip() for part in line.split(",")]
                if len(parts) != 2 or not all(parts):
                    raise ValueError(f"{path}:{number}: a data.txt line is `media folder,data file`; fix the line")
                folder, listing = (path.parent / part for part in parts)
                listed += read_listing([str(listing)], str(folder))
            continue
        if path.suffix == ".json":
            try:
                records = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: not JSON ({error}); give a JSON list of samples or a .jsonl file") from None
            if not isinstance(records, list):
                raise ValueError(f"{path}: a JSON data file is a list of samples; give a list or a .jsonl file")
            numbered = list(enumerate(records, 1))
        else:
            numbered = []
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        numbered.append((number, json.loads(line)))
                    except json.JSONDecodeError as error:
                        raise ValueError(f"{path}:{number}: not a JSON line ({error}); fix the line") from None
        base = Path(media_dir) if media_dir else path.parent
        for number, record in numbered:
            where = f"{path}:{number}"
            if not isinstance(record, dict) or not record.get("path"):
                raise ValueError(f"{where}: a sample needs `path` (and `cap`); fix the line")
            listed.append((record, base / record["path"], where))
    return listed


def probe_media(path: Path, record: dict) -> tuple[bool, int, float, int, int]:
    """``(is_image, frames, fps, height, width)`` of a media file from its header (the record fills gaps).

    Raises:
        BadSample: the file does not exist or cannot be read as an image or a video.
    """
    if not path.is_file():
        raise BadSample(f"{path} does not exist")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        from PIL import Image

        try:
            with Image.open(path) as image:
                width, height = image.size
        except Exception as error:  # noqa: BLE001  (any decoder failure means an unreadable image)
            raise BadSample(f"{path} is not a readable image ({type(error).__name__}: {error})") from None
        return True, 1, 0.0, height, width
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise BadSample(f"{path} has no video stream")
            stream = container.streams.video[0]
            frames = stream.frames or int(record.get("num_frames") or 0)
            fps = float(stream.average_rate or record.get("fps") or 0)
            if not frames:  # no count in the header: count by decoding
                frames = sum(1 for _ in container.decode(stream))
            height, width = stream.codec_context.height, stream.codec_context.width
    except BadSample:
        raise
    except Exception as error:  # noqa: BLE001  (any container or codec failure means an unreadable video)
        raise BadSample(f"{path} is not a readable video ({type(error).__name__}: {error})") from None
    return False, frames, fps, height, width


def sample_frames(source_frames: int, source_fps: float, counts: list[int], fps: float) -> tuple[int, ...] | None:
    """Source frame indices for the largest of ``counts`` a video of ``source_frames`` fills at ``fps``
    (every ``source_fps / fps`` frames from the first; ``fps`` 0 or an unknown source rate: every
    frame); None when even the smallest does not fit."""
    stride = source_fps / fps if fps > 0 and source_fps > 0 else 1.0
    for count in sorted(counts, reverse=True):
        indices = tuple(int(round(i * stride)) for i in range(count))
        if indices[-1] < source_frames:
            return indices
    return None


def pick_resolution(height: int, width: int, resolutions: list[list[int]], stride: int) -> tuple[int, int]:
    """The bucket of the closest aspect ratio (the first on a tie), or the size floored to ``stride``."""
    if resolutions:
        best = min(resolutions, key=lambda hw: abs(math.log((hw[0] / hw[1]) / (height / width))))
        return int(best[0]), int(best[1])
    return max(stride, height // stride * stride), max(stride, width // stride * stride)


def _condition_path(record: dict, path: Path) -> Path:
    """The record's ``condition_image``, relative to the folder its ``path`` is relative to.

    Raises:
        BadSample: no ``condition_image``, or not a file.
    """
    name = record.get("condition_image")
    if not isinstance(name, str) or not name:
        raise BadSample(f"{path} has no source image: add `condition_image` (the image to edit) to the record")
    base = path.parents[len(Path(record["path"]).parts) - 1] if not Path(record["path"]).is_absolute() else Path()
    condition = base / name
    if not condition.is_file():
        raise BadSample(f"condition_image {condition} does not exist")
    return condition


def plan_media(
    files: list[str],
    media_dir: str | None,
    resolutions: list[list[int]],
    stride: int,
    frame_counts: list[int],
    fps: float,
    skip_bad: bool,
    images_only: bool = False,
    needs_condition: bool = False,
) -> list[MediaSample]:
    """Every usable sample of ``files`` with its target shape (see the module docstring).

    Args:
        images_only: the model takes images (FLUX): a video is a bad sample.
        needs_condition: the model edits a source image: a record without a readable ``condition_image`` is a
            bad sample.

    Raises:
        BadSample: the first bad sample, naming its file and line (unless ``skip_bad``).
        ValueError: no usable sample at all.
    """
    samples, bad = [], 0
    for record, path, where in read_listing(files, media_dir):
        try:
            caption = record.get("cap", record.get("caption"))
            if isinstance(caption, list):  # MindSpeed-MM allows several captions; the first is used
                caption = caption[0] if caption else None
            if not isinstance(caption, str) or not caption.strip():
                raise BadSample(f"{path} has no caption (`cap`)")
            is_image, count, source_fps, height, width = probe_media(path, record)
            if images_only and not is_image:
                raise BadSample(f"{path} is a video; this model trains on images")
            condition = _condition_path(record, path) if needs_condition else None
            frames = (0,) if is_image else sample_frames(count, source_fps, frame_counts, fps)
            if frames is None:
                raise BadSample(
                    f"{path} has {count} frames at {source_fps:g} fps: too few for "
                    f"{min(frame_counts)} frames at data.fps={fps:g}"
                )
        except BadSample as error:
            if not skip_bad:
                raise BadSample(f"{where}: {error}; fix or remove the sample, or set data.skip_bad=true") from None
            bad += 1
            logger.warning("skipping %s: %s", where, error)
            continue
        target = pick_resolution(height, width, resolutions, stride)
        samples.append(MediaSample(path, caption, where, is_image, frames, *target, condition))
    if bad:
        logger.warning("data.skip_bad: %d of %d samples skipped", bad, bad + len(samples))
    if not samples:
        raise ValueError(f"data.files={files}: no usable sample; check the paths and captions")
    return samples
