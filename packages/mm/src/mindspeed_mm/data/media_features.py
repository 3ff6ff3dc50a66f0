"""Features computed from raw media as they are read: what a feature cache holds, without the cache.

:class:`MediaFeatures` has :class:`~mindspeed_mm.data.features.FeatureSet`'s reading interface
(``len``, ``[i]``, ``shapes``, ``null``, ``entries``, ``directory``), so the DiT task trains straight
from ``data.files`` when ``data.features`` is unset; ``extract-features`` writes its samples to a
cache. Sample ``i``'s latents are the VAE's of its decoded pixels, its text the text encoders' of
its caption, each encoded alone (so a cache and the raw run hold the same numbers). For a family
with conditions (Wan I2V) the sample's first frame, as an 8-bit image, is the pipeline's input image
(:attr:`~mindspeed_mm.models.dit.DiTFamily.image_conditions`: ``image_latents``, ``image_embeds``). For an
image-editing family (Qwen-Image-Edit: ``image_prompts``) the record's ``condition_image`` is the source image:
its ``image_latents``, and the caption encoded together with it as the sample's ``text`` (with
``diffusion.text_dropout`` also the empty prompt encoded with it, ``null_text``, which the dropout substitutes).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mindspeed.device import get_accelerator
from mindspeed_mm.config import MMConfig
from mindspeed_mm.data.decode import load_pixels
from mindspeed_mm.data.encoder_set import EncoderSet
from mindspeed_mm.data.media import MediaSample, plan_media, read_listing
from mindspeed_mm.models.dit import DiTFamily
from mindspeed_mm.models.encoders import first_frame_image


def encoders_dir(config: MMConfig) -> Path:
    """``data.encoders``, else the folder above ``model.path`` (a pipeline's ``transformer`` folder)."""
    return Path(config.data.encoders) if config.data.encoders else Path(config.model.path).parent


class MediaFeatures:
    """The samples of ``data.files``, planned up front (buckets known), encoded when read.

    Raises:
        ValueError: a frame count the VAE cannot take (``data.frame_counts``), or what
            :func:`~mindspeed_mm.data.media.plan_media` raises.
    """

    def __init__(self, config: MMConfig, family: DiTFamily) -> None:
        d = config.data
        self.family = family
        #: an editing family with text dropout: each sample's empty prompt encoded with its source image too
        self.null_per_sample = family.image_prompts and config.diffusion.text_dropout > 0
        self.directory = encoders_dir(config)
        model_config = family.load_class().load_config(str(config.model.path))
        #: the conditions the model takes (computed from each sample's first frame)
        self.condition_keys = family.condition_keys(model_config)
        folders = tuple(name for name, used in family.condition_folders if used(model_config))
        self.encoders = EncoderSet(
            self.directory,
            family.architecture,
            d.text_len or family.text_len,
            get_accelerator().device(),
            getattr(torch, d.vae_dtype),
            getattr(torch, d.text_encoder_dtype),
            folders,
        )
        images_only = family.latent_dims == 3
        stride = self.encoders.time_stride()
        if not images_only:
            wrong = [n for n in d.frame_counts if n < 1 or (n - 1) % stride]
            if wrong:
                raise ValueError(
                    f"data.frame_counts={d.frame_counts}: {wrong} are not k x {stride} + 1 frames, which "
                    f"{self.directory / 'vae'} needs (its time stride is {stride}); e.g. {4 * stride + 1}"
                )
        self.samples: list[MediaSample] = plan_media(
            d.files,
            d.image_dir,
            d.resolutions,
            d.hw_stride,
            d.frame_counts,
            d.fps,
            d.skip_bad,
            images_only,
            family.image_prompts,
        )
        self.entries = [{"id": f"{i:06d}", "caption": s.caption, "where": s.where} for i, s in enumerate(self.samples)]
        #: listed samples left out by ``data.skip_bad`` before decoding
        self.skipped = len(read_listing(d.files, d.image_dir)) - len(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def pixels(self, index: int) -> torch.Tensor:
        """Sample ``index``'s pixels as the VAE takes them (``[3, F, H, W]``, or ``[3, H, W]`` for an image model)."""
        pixels = load_pixels(self.samples[index])
        return pixels[:, 0] if self.family.latent_dims == 3 else pixels

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Sample ``index``'s ``latents``, ``text`` (and ``pooled``, and the family's conditions)."""
        pixels = self.pixels(index)
        sample = {"latents": self.encoders.encode_pixels(pixels)}
        if self.family.image_prompts:  # an editing record: the instruction encoded with its source image
            sample.update(self._edit_conditions(self.samples[index]))
            return sample
        sample.update(self.encoders.encode_text(self.samples[index].caption))
        if self.condition_keys:
            parts = {"vae": self.encoders.vae, **self.encoders.condition_parts}
            frames, height, width = pixels.shape[1:]
            last = {"last_image": first_frame_image(pixels, -1)} if self.family.last_frame else {}
            conditions = self.family.image_conditions(parts, first_frame_image(pixels), frames, height, width, **last)
            sample.update({key: conditions[key].float().cpu() for key in self.condition_keys})
        return sample

    def _edit_conditions(self, media: MediaSample) -> dict[str, torch.Tensor]:
        """``text`` (the caption's real tokens encoded with the source image) and the source image's conditions."""
        from PIL import Image

        with Image.open(media.condition) as opened:
            image = opened.convert("RGB")
        tokenizer, encoder = self.encoders.text_parts[:2]
        parts = {"vae": self.encoders.vae, "tokenizer": tokenizer, "text_encoder": encoder}
        parts.update(self.encoders.condition_parts)
        captions = [media.caption, ""] if self.null_per_sample else [media.caption]
        # one prompt a call: a batch would pad the shorter prompt for the text encoder (last-bit differences)
        texts = [
            self.family.encode_prompts(parts, [c], self.encoders.max_length, images=[image])[0][0] for c in captions
        ]
        out = {name: _real_rows(text) for name, text in zip(("text", "null_text"), texts)}
        conditions = self.family.image_conditions(parts, image, 1, media.height, media.width)
        out.update({key: conditions[key].float().cpu() for key in self.condition_keys})
        return out

    def shapes(self) -> list[tuple[int, ...]]:
        """Each sample's bucket ``(frames, height, width)`` (one bucket per latent shape)."""
        return [s.key() for s in self.samples]

    def null(self) -> dict[str, torch.Tensor]:
        """The empty caption's ``text`` (and ``pooled``)."""
        return self.encoders.encode_text("")


def _real_rows(text: torch.Tensor) -> torch.Tensor:
    """``text`` ``[L, D]`` without its trailing all-zero (padding) rows, float32 on the CPU."""
    real = text.ne(0).any(dim=-1).nonzero()
    return text[: int(real.max()) + 1 if len(real) else 0].float().cpu()
