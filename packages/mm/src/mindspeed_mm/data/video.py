"""Decoding the videos of vision-language samples (PyAV), as LLaMA-Factory's multimodal plugins do.

A video is a file (any container PyAV opens), a folder of frame images (sorted by name), or a
list of frame image paths. A file is sampled at ``data.video_fps`` frames per second of its
duration, at most ``data.video_maxlen`` frames, evenly spaced over all its frames
(``linspace(0, total - 1, n)``, LLaMA-Factory's ``_get_video_sample_indices``); the frames of a
folder or a list are all taken (up to ``video_maxlen``, evenly spaced) and count as sampled at
``video_fps``. Every frame is then resized, aspect kept, so that its pixel count lies within
``[video_min_pixels, video_max_pixels]`` (LLaMA-Factory's ``_preprocess_image``); the model's video
processor applies its own size rules after that, as in LLaMA-Factory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mindspeed_mm.data.media import IMAGE_SUFFIXES


@dataclass(frozen=True)
class VideoSettings:
    """How videos are decoded (``data.video_*``, LLaMA-Factory's names).

    Attributes:
        fps: frames sampled per second of video.
        maxlen: at most this many frames per video.
        max_pixels: frames are resized to at most this many pixels.
        min_pixels: and to at least this many.
    """

    fps: float = 2.0
    maxlen: int = 128
    max_pixels: int = 65536
    min_pixels: int = 256


@dataclass
class VideoClip:
    """One decoded video.

    Attributes:
        frames: RGB PIL images, resized within the settings' pixel bounds.
        fps: the source's frame rate (a frame list's: ``VideoSettings.fps``).
        indices: the source frame index of each frame.
        total_frames: frames in the source.
    """

    frames: list[Any]
    fps: float
    indices: list[int]
    total_frames: int

    @property
    def duration(self) -> float:
        """Seconds of the source."""
        return self.total_frames / self.fps

    @property
    def sampled_fps(self) -> float:
        """Frames taken per second of the source (Qwen2.5-VL's ``second_per_grid_ts`` is ``temporal_patch / this``)."""
        return len(self.frames) / self.duration

    def metadata(self) -> dict[str, Any]:
        """transformers' ``VideoMetadata`` fields (Qwen3-VL's timestamps come from ``fps`` and ``frames_indices``)."""
        return {
            "total_num_frames": self.total_frames,
            "fps": self.fps,
            "duration": self.duration,
            "frames_indices": list(self.indices),
        }


def sample_indices(total_frames: int, duration: float, fps: float, maxlen: int) -> list[int]:
    """LLaMA-Factory's frame choice: ``min(total, maxlen, floor(duration x fps))`` (at least 1) frames evenly spaced."""
    count = min(total_frames, maxlen, max(1, math.floor(duration * fps)))
    return np.linspace(0, total_frames - 1, count).astype(np.int32).tolist()


def resize_within(image: Any, min_pixels: int, max_pixels: int) -> Any:
    """``image`` (PIL) scaled, aspect kept, so its pixel count lies in ``[min_pixels, max_pixels]``; RGB."""
    image.load()  # read now: a frame file is closed after this
    if image.width * image.height > max_pixels:
        factor = math.sqrt(max_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    if image.width * image.height < min_pixels:
        factor = math.sqrt(min_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_video(video: str | tuple[str, ...], settings: VideoSettings, source: str) -> VideoClip:
    """The sampled, resized frames of ``video`` (a file, a frame folder, or frame paths).

    Raises:
        ValueError: naming ``source`` (the sample's file and line), the video and the fix, for an
            unreadable file, a file without a video stream or frames, or an empty frame folder.
    """
    from PIL import Image

    if isinstance(video, str) and Path(video).is_dir():
        frames = sorted(str(p) for p in Path(video).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not frames:
            raise ValueError(
                f"{source}: video folder {video} holds no frame images ({', '.join(IMAGE_SUFFIXES)}); "
                "add its frames or give a video file"
            )
        video = tuple(frames)
    if isinstance(video, tuple):
        keep = np.linspace(0, len(video) - 1, min(len(video), settings.maxlen)).astype(np.int32).tolist()
        images = []
        for index in keep:
            try:
                with Image.open(video[index]) as frame:
                    images.append(resize_within(frame, settings.min_pixels, settings.max_pixels))
            except OSError as err:
                raise ValueError(
                    f"{source}: video frame {video[index]} cannot be read ({err}); fix or remove it"
                ) from err
        return VideoClip(images, settings.fps, keep, len(video))
    return _decode_file(video, settings, source)


class _BadVideo(ValueError):
    """A video this module rejects itself (PyAV's own errors are ``ValueError`` too, and are wrapped)."""


def _decode_file(path: str, settings: VideoSettings, source: str) -> VideoClip:
    import av

    fix = "re-encode it (e.g. ffmpeg -i IN -c:v libx264 OUT.mp4) or remove the sample"
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise _BadVideo(f"{source}: video {path} has no video stream; {fix}")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            total = stream.frames
            if not total:  # no count in the header: count by decoding
                total = sum(1 for _ in container.decode(stream))
                container.seek(0)
            if not total or not rate:
                raise _BadVideo(f"{source}: video {path} has no frames or no frame rate; {fix}")
            duration = float(stream.duration * stream.time_base) if stream.duration else total / rate
            wanted = sample_indices(total, duration, settings.fps, settings.maxlen)
            picked, frames, index = set(wanted), [], -1
            for index, frame in enumerate(container.decode(stream)):
                if index in picked:
                    frames.append(resize_within(frame.to_image(), settings.min_pixels, settings.max_pixels))
                if index >= wanted[-1]:
                    break
    except _BadVideo:
        raise
    except Exception as err:  # noqa: BLE001  (any container or codec failure means an unreadable video)
        raise ValueError(f"{source}: video {path} cannot be decoded ({type(err).__name__}: {err}); {fix}") from None
    if len(frames) < len(wanted):
        raise ValueError(f"{source}: video {path} decodes to {index + 1} frames but its header says {total}; {fix}")
    return VideoClip(frames, rate, wanted, total)
