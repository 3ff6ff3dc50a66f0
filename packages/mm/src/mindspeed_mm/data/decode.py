"""Decoding a planned media sample into the pixels a VAE encodes: PyAV for video, Pillow for images.

The frames a :class:`~mindspeed_mm.data.media.MediaSample` names are decoded as RGB, resized
(bilinear, antialiased) so that they cover the target size with the aspect ratio kept, cropped at
the centre, and scaled to [-1, 1], as MindSpeed-MM's ``CenterCropResizeVideo`` and
``ToTensorVideo`` / ``norm_fun`` transforms do.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mindspeed_mm.data.media import BadSample, MediaSample


def decode_frames(sample: MediaSample) -> np.ndarray:
    """The sample's frames as uint8 ``[F, H, W, 3]`` (source size).

    Raises:
        BadSample: the file cannot be decoded or ends before the last frame the sample needs.
    """
    if sample.is_image:
        from PIL import Image

        try:
            with Image.open(sample.path) as image:
                return np.array(image.convert("RGB"))[None]
        except Exception as error:  # noqa: BLE001  (any decoder failure means an unreadable image)
            raise BadSample(f"{sample.where}: {sample.path} is not a readable image ({error})") from None
    import av

    wanted = sample.frames
    frames: list[np.ndarray] = []
    try:
        with av.open(str(sample.path)) as container:
            position, needed = 0, iter(wanted)
            target = next(needed)
            for frame in container.decode(container.streams.video[0]):
                while target == position:  # a frame taken more than once when the target rate is higher
                    frames.append(frame.to_ndarray(format="rgb24"))
                    target = next(needed, None)
                if target is None:
                    break
                position += 1
    except Exception as error:  # noqa: BLE001  (any container or codec failure means an unreadable video)
        raise BadSample(f"{sample.where}: {sample.path} is not a readable video ({error})") from None
    if len(frames) < len(wanted):
        raise BadSample(f"{sample.where}: {sample.path} decodes to {position} frames; frame {wanted[-1]} is needed")
    return np.stack(frames)


def resize_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[F, 3, H, W]`` float frames resized to cover ``height x width`` (aspect kept) and centre-cropped to it."""
    source_h, source_w = frames.shape[-2:]
    scale = max(height / source_h, width / source_w)
    size = (max(height, round(source_h * scale)), max(width, round(source_w * scale)))
    if size != (source_h, source_w):
        frames = F.interpolate(frames, size=size, mode="bilinear", align_corners=False, antialias=True)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    return frames[..., top : top + height, left : left + width]


def load_pixels(sample: MediaSample) -> torch.Tensor:
    """The sample's pixels in [-1, 1], ``[3, F, H, W]`` at its target size (F = 1 for an image)."""
    frames = torch.from_numpy(decode_frames(sample)).permute(0, 3, 1, 2).float()
    frames = resize_crop(frames, sample.height, sample.width).clamp(0, 255)
    return (frames / 127.5 - 1.0).permute(1, 0, 2, 3).contiguous()
