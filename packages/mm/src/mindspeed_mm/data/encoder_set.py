"""The VAE and text encoder(s) of a diffusers pipeline directory, loaded for feature extraction.

A pipeline directory holds ``vae/`` (a diffusers VAE: ``_class_name`` in its config.json),
``text_encoder/`` and ``tokenizer/`` (transformers), and for FLUX ``text_encoder_2/`` and
``tokenizer_2/`` (SD3: ``_3`` too); an image-to-video family names more folders (Wan2.1 I2V: ``image_encoder/`` and
``image_processor/``, loaded as the pipeline's ``model_index.json`` records them). Which text encoders a transformer needs, and how their outputs become the
cache's ``text`` / ``pooled``, is registered per transformer class in :data:`TEXT_ENCODINGS`
(:mod:`mindspeed_mm.models.encoders` computes them as the pipelines do).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.registry import Registry
from mindspeed_mm.models.encoders import encode_latents, encode_qwen_image, encode_sd3, encode_t5_clip, encode_umt5


@dataclass(frozen=True)
class TextEncoding:
    """How a transformer class's text inputs are computed.

    Attributes:
        folders: ``(text encoder folder, tokenizer folder)`` pairs of the pipeline directory, in the
            order ``encode`` takes them.
        encode: ``(tokenizers and encoders interleaved as folders, captions, max_length) -> per caption
            {"text": [L, D], maybe "pooled": [P]}``.
    """

    folders: tuple[tuple[str, str], ...]
    encode: Callable[..., list[dict[str, torch.Tensor]]]


def _umt5(tokenizer: Any, encoder: Any, captions: list[str], max_length: int) -> list[dict[str, torch.Tensor]]:
    return [{"text": text} for text in encode_umt5(tokenizer, encoder, captions, max_length)]


#: diffusers transformer ``_class_name`` -> its text encoding.
TEXT_ENCODINGS: Registry[TextEncoding] = Registry("text encoding")
TEXT_ENCODINGS.register("WanTransformer3DModel", TextEncoding((("text_encoder", "tokenizer"),), _umt5))
TEXT_ENCODINGS.register(
    "FluxTransformer2DModel",
    TextEncoding((("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")), encode_t5_clip),
)
TEXT_ENCODINGS.register(
    "SD3Transformer2DModel",
    TextEncoding(
        (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"), ("text_encoder_3", "tokenizer_3")),
        encode_sd3,
    ),
)

TEXT_ENCODINGS.register(
    "QwenImageTransformer2DModel", TextEncoding((("text_encoder", "tokenizer"),), encode_qwen_image)
)


def _load_diffusers(directory: Path, dtype: torch.dtype) -> Any:
    config = directory / "config.json"
    if not config.is_file():
        raise ValueError(f"{directory} has no config.json; data.encoders must hold the pipeline's vae folder")
    name = json.loads(config.read_text()).get("_class_name")
    cls = getattr(importlib.import_module("diffusers"), name or "", None)
    if cls is None:
        raise ValueError(f"{config}: `_class_name` {name!r} is not a diffusers class; give a diffusers VAE folder")
    return cls.from_pretrained(str(directory), torch_dtype=dtype, local_files_only=True)


def _load_transformers(directory: Path, dtype: torch.dtype) -> Any:
    import transformers

    config = directory / "config.json"
    if not config.is_file():
        raise ValueError(f"{directory} has no config.json; data.encoders must hold the pipeline's text encoder folders")
    names = json.loads(config.read_text()).get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise ValueError(f"{config}: `architectures` {names} names no transformers class; give a text encoder folder")
    return cls.from_pretrained(str(directory), torch_dtype=dtype, local_files_only=True)


def _load_part(directory: Path, name: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The pipeline folder ``name`` as its ``model_index.json`` records its class (else a transformers model)."""
    folder = directory / name
    if not folder.is_dir():
        raise ValueError(f"{folder} does not exist; data.encoders must hold the pipeline's {name} folder")
    index = directory / "model_index.json"
    spec = json.loads(index.read_text()).get(name) if index.is_file() else None
    if not isinstance(spec, list) or spec[0] is None:
        return _load_transformers(folder, dtype).to(device).eval()
    cls = getattr(importlib.import_module(spec[0]), spec[1])
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):  # a processor
        return cls.from_pretrained(str(folder), local_files_only=True)
    return cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True).to(device).eval()


class EncoderSet:
    """A pipeline's VAE and text encoder(s) in eval mode on ``device``.

    Args:
        directory: the pipeline directory (``data.encoders``).
        architecture: the transformer's ``_class_name`` (picks the text encoders).
        max_length: text tokens (``data.text_len``).
        vae_dtype: the VAE's dtype. text_dtype: the text encoders' (and an image encoder's).
        condition_folders: further pipeline folders the family's conditions need, loaded into
            :attr:`condition_parts` by folder name.

    Raises:
        ValueError: a missing folder or an unknown class (naming the path).
    """

    def __init__(
        self,
        directory: str | Path,
        architecture: str,
        max_length: int,
        device: torch.device,
        vae_dtype: torch.dtype = torch.float32,
        text_dtype: torch.dtype = torch.float32,
        condition_folders: tuple[str, ...] = (),
    ) -> None:
        from transformers import AutoTokenizer

        self.directory, self.max_length, self.device = Path(directory), max_length, device
        self.encoding = TEXT_ENCODINGS.get(architecture)
        self.vae = _load_diffusers(self.directory / "vae", vae_dtype).to(device).eval()
        self.text_parts: list[Any] = []
        for encoder, tokenizer in self.encoding.folders:
            if not (self.directory / tokenizer).is_dir():
                raise ValueError(
                    f"{self.directory / tokenizer} does not exist; data.encoders must hold the "
                    f"pipeline's {tokenizer} folder"
                )
            self.text_parts += [
                AutoTokenizer.from_pretrained(str(self.directory / tokenizer), local_files_only=True),
                _load_transformers(self.directory / encoder, text_dtype).to(device).eval(),
            ]
        self.condition_parts = {
            name: _load_part(self.directory, name, text_dtype, device) for name in condition_folders
        }

    def time_stride(self) -> int:
        """Frames the VAE folds into one latent frame (4 for Wan's; 1 for an image VAE)."""
        downsample = getattr(self.vae.config, "temperal_downsample", None)
        return 2 ** sum(bool(d) for d in downsample) if downsample is not None else 1

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised float32 latents of one sample's pixels ``[3, F, H, W]`` (or ``[3, H, W]``), on the CPU."""
        return encode_latents(self.vae, pixels[None].to(self.device, self.vae.dtype))[0].float().cpu()

    @torch.no_grad()
    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        """``{"text": [L, D], maybe "pooled": [P]}`` of one caption, float32 on the CPU."""
        out = self.encoding.encode(*self.text_parts, [caption], self.max_length)[0]
        return {key: value.float().cpu() for key, value in out.items()}
