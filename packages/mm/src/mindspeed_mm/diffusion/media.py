"""Writing samples: ``.png`` images, ``.gif`` (Pillow) and ``.mp4`` (PyAV, where installed) videos, contact sheets.

Every file is written under a temporary name and renamed, so an interrupted run leaves no half file.
Pixels come in as float tensors in [0, 1]: ``[3, H, W]`` for an image, ``[F, 3, H, W]`` for a video.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """``[..., 3, H, W]`` in [0, 1] -> ``[..., H, W, 3]`` uint8 (rounded as diffusers' ``numpy_to_pil``)."""
    return (pixels.float().clamp(0, 1).movedim(-3, -1).cpu().numpy() * 255).round().astype(np.uint8)


def _replace(tmp: Path, path: Path) -> Path:
    os.replace(tmp, path)
    return path


def write_png(path: str | Path, image: torch.Tensor) -> Path:
    """Write one image ``[3, H, W]``."""
    from PIL import Image

    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    Image.fromarray(to_uint8(image)).save(tmp, format="PNG")
    return _replace(tmp, path)


def write_gif(path: str | Path, frames: torch.Tensor | list[Any], fps: int = 8, scale: int = 1) -> Path:
    """Write a looping GIF of ``frames`` (``[F, 3, H, W]`` in [0, 1], or PIL images), enlarged ``scale`` times."""
    from PIL import Image

    path = Path(path)
    images = [Image.fromarray(f) for f in to_uint8(frames)] if isinstance(frames, torch.Tensor) else list(frames)
    if scale > 1:
        images = [im.resize((im.width * scale, im.height * scale), Image.NEAREST) for im in images]
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    images[0].save(
        tmp, format="GIF", save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0
    )
    return _replace(tmp, path)


def mp4_available() -> bool:
    """Whether PyAV (``av``) is installed to write ``.mp4``."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def write_mp4(path: str | Path, frames: torch.Tensor, fps: int = 8) -> Path:
    """Write ``frames`` (``[F, 3, H, W]`` in [0, 1]) as H.264 ``.mp4`` through PyAV (sizes rounded up to even)."""
    import av

    path = Path(path)
    video = to_uint8(frames)
    height, width = video.shape[1] + video.shape[1] % 2, video.shape[2] + video.shape[2] % 2
    video = np.pad(video, ((0, 0), (0, height - video.shape[1]), (0, width - video.shape[2]), (0, 0)), mode="edge")
    tmp = path.with_name(f".{path.stem}.partial-{os.getpid()}.mp4")
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return _replace(tmp, path)


def contact_sheet(
    samples: list[torch.Tensor],
    captions: list[str],
    scale: int = 1,
    columns: int | None = None,
    frame: int | None = None,
) -> Any:
    """A PIL image: one cell per sample (an image ``[3, H, W]``, or frame ``frame`` of a video ``[F, 3, H, W]``)
    with its caption under it, ``columns`` cells a row (default: up to 4)."""
    from PIL import Image, ImageDraw

    cells = [s if s.ndim == 3 else s[frame or 0] for s in samples]
    images = [Image.fromarray(to_uint8(c)) for c in cells]
    images = [im.resize((im.width * scale, im.height * scale), Image.NEAREST) for im in images]
    columns = columns or min(4, len(images))
    rows = -(-len(images) // columns)
    per_line = max(1, max(im.width for im in images) // 6)  # Pillow's default font: ~6 pixels a character
    wrapped = ["\n".join(textwrap.wrap(c, per_line, break_long_words=True)) for c in captions]
    label = 11 * max(w.count("\n") + 1 for w in wrapped) + 2
    cell_w, cell_h = max(im.width for im in images) + 4, max(im.height for im in images) + label + 4
    sheet = Image.new("RGB", (columns * cell_w, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, (im, text) in enumerate(zip(images, wrapped)):
        x, y = (i % columns) * cell_w + 2, (i // columns) * cell_h + 2
        sheet.paste(im, (x, y))
        draw.multiline_text((x, y + im.height + 1), text, fill=(0, 0, 0), spacing=1)
    return sheet


def write_contact_sheets(
    directory: str | Path, samples: list[torch.Tensor], captions: list[str], fps: int = 8, scale: int = 1
) -> list[Path]:
    """``contact_sheet.png`` (images; first frames of videos) and, for videos, ``contact_sheet.gif`` (all frames)."""
    directory = Path(directory)
    sheet = contact_sheet(samples, captions, scale)
    tmp = directory / f".contact_sheet.png.partial-{os.getpid()}"
    sheet.save(tmp, format="PNG")
    written = [_replace(tmp, directory / "contact_sheet.png")]
    if samples[0].ndim == 4:
        frames = [contact_sheet(samples, captions, scale, frame=f) for f in range(samples[0].shape[0])]
        written.append(write_gif(directory / "contact_sheet.gif", frames, fps))
    return written
