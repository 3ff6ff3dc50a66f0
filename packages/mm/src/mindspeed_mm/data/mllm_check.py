"""Vision-language samples whose media cannot be read, found when the task is built (not at step N).

Every image of every sample is opened and checked (:meth:`PIL.Image.Image.verify`: the header and,
for PNG, every chunk's checksum; nothing is decoded), every video file's container is probed
(:func:`~mindspeed_mm.data.media.probe_media`), every frame of a frame-list video opened, every audio clip's ``.wav`` header read. A bad
sample is, as for the diffusion data (:func:`~mindspeed_mm.data.media.plan_media`), one line naming
its file and line and the fix, or with ``data.skip_bad`` a warning per sample, left out, and one
summary line with the count. A sample that passes these checks and still fails when it is encoded
(an image truncated after its header) is skipped then, with ``data.skip_bad``, by the task.
"""

from __future__ import annotations

from pathlib import Path

from mindspeed.log import get_logger
from mindspeed_mm.data.media import IMAGE_SUFFIXES, BadSample, probe_media
from mindspeed_mm.data.mllm import MllmSample

logger = get_logger(__name__)


def _check_image(path: str) -> None:
    from PIL import Image

    if not Path(path).is_file():
        raise BadSample(f"image {path} does not exist")
    try:
        with Image.open(path) as image:
            image.verify()
    except Exception as error:  # noqa: BLE001  (any decoder failure means an unreadable image)
        raise BadSample(f"image {path} cannot be read ({type(error).__name__}: {error})") from None


def _check_audio(path: str) -> None:
    import wave

    if not Path(path).is_file():
        raise BadSample(f"audio {path} does not exist")
    try:
        with wave.open(path, "rb") as clip:
            clip.getparams()
    except (OSError, EOFError, wave.Error) as error:
        raise BadSample(f"audio {path} cannot be read as a PCM .wav ({type(error).__name__}: {error})") from None


def _check_video(video: str | tuple[str, ...]) -> None:
    if isinstance(video, str) and Path(video).is_dir():
        video = tuple(sorted(str(p) for p in Path(video).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES))
    if isinstance(video, tuple):
        for frame in video:
            _check_image(frame)
        return
    probe_media(Path(video), {})


def check_mllm_media(
    samples: list[MllmSample], skip_bad: bool, what: str = "data.files"
) -> tuple[list[MllmSample], int]:
    """The samples whose media can all be read, and how many were left out.

    Raises:
        BadSample: (a ``ValueError``) the first bad sample, naming its file, line and medium, unless ``skip_bad``.
        ValueError: no usable sample at all.
    """
    kept, bad = [], 0
    for sample in samples:
        try:
            for path in sample.images:
                _check_image(path)
            for video in sample.videos:
                _check_video(video)
            for path in sample.audios:
                _check_audio(path)
        except BadSample as error:
            if not skip_bad:
                raise BadSample(
                    f"{sample.source}: {error}; fix or remove the sample, or set data.skip_bad=true"
                ) from None
            bad += 1
            logger.warning("skipping %s: %s", sample.source, error)
            continue
        kept.append(sample)
    if bad:
        logger.warning("data.skip_bad: %d of %d samples of %s skipped", bad, bad + len(kept), what)
    if samples and not kept:
        raise ValueError(f"{what}: no sample has readable media; check the image and video paths")
    return kept, bad
