"""What a diffusion-transformer family declares, and the registry of families by diffusers' ``_class_name``.

A family is the one description of a diffusers transformer class that the suite needs: its
FSDP2 wrapping plan, the layout of its latents, how the noisy latents, timesteps and text
embeddings become the arguments of its ``forward`` (and its output the velocity in the latents'
layout), its default text length, and its tiny configuration. Models are diffusers' own
classes loaded from diffusers directories (``config.json`` with ``_class_name`` plus
``diffusion_pytorch_model.safetensors``), so checkpoints stay diffusers checkpoints.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models.dit_parallel import SequencePlan
from mindspeed_mm.models.manifest import DIT_MODULES, ManifestRegistry


@dataclass(frozen=True)
class DiTFamily:
    """One diffusers transformer class.

    Attributes:
        architecture: the ``_class_name`` of its config.json.
        model_class: the diffusers class, as ``module:Name`` (imported when used).
        fsdp_plan: module-name patterns wrapped as FSDP2 units (innermost first; ``{*}`` matches one name part).
        latent_dims: dimensions of one sample's latents: 4 (``C, F, H, W``, video) or 3 (``C, H, W``, image).
        model_inputs: ``(model config, noisy latents [B, ...], sigmas [B], text [B, L, D], pooled [B, P] or
            None, guidance scale, **conditions) -> forward kwargs`` (``conditions``: the batch's tensors of
            the :attr:`conditions` keys).
        prediction: ``(model output, latents' shape) -> velocity in the latents' layout``.
        tokens: ``(model config, one sample's latent shape) -> tokens`` the transformer sees.
        tiny_config: the constructor arguments of a tiny model (CPU tests and demos).
        text_len: text embeddings are zero-padded to this many tokens by default.
        needs_pooled: the model takes a pooled text embedding (FLUX's CLIP projection).
        fp32_inputs: ``forward`` arguments kept in float32 under bf16 mixed precision (timesteps:
            rounding 999.0 to bf16 moves it by up to 4 steps of the grid).
        parts: named parts for ``model.freeze`` (none: module-name prefixes only).
        timestep_divisor: sampling passes ``scheduler timestep / timestep_divisor`` as ``timestep`` (the
            pipeline's own arithmetic: Wan 1, FLUX 1000).
        scheduler: the pipeline's default sampling scheduler, ``(diffusers class name, config)``, used
            when a pipeline directory has no ``scheduler`` folder.
        timestep_kwargs: ``(scheduler config, steps, latent shape) -> set_timesteps kwargs`` beyond the
            step count, as the pipeline computes them (FLUX: its sigmas and resolution-dependent ``mu``).
        encode_prompts: ``(pipeline parts, captions, text length) -> (text [B, L, D], pooled [B, P] or
            None)`` as the pipeline encodes prompts (the parts are the pipeline directory's text
            encoders and tokenizers, by folder name).
        encode_options: keywords ``encode_prompts`` also takes, as ``generate`` flags (SD3: ``clip_skip``).
        sequence_plan: where its tokens are split and gathered under sequence parallelism
            (:mod:`mindspeed_mm.models.dit_parallel`); None: not supported.
        lora_targets: the linears ``lora.target_modules: [default]`` adapts, by the last parts of their
            module names (the attention projections diffusers' LoRA training scripts target).
        variant: the family's name beside its class (Wan image-to-video: ``i2v``); it is registered as
            ``architecture:variant`` (:attr:`key`).
        select_variant: ``config.json as a dict -> variant or ""``: which family of the class a model
            directory is (Wan: ``i2v`` when its input has more channels than its output).
        conditions: per-sample tensors besides latents and text that the cache holds and ``model_inputs``
            takes, with ``(model config) -> whether the model takes it`` (Wan I2V: ``image_latents``,
            and ``image_embeds`` where the config has ``image_dim``).
        image_conditions: ``(pipeline parts by folder name, a PIL image, frames, height, width) -> one
            sample's conditions`` as the pipeline computes them from its input image (``generate --image``;
            extract-features and training from raw media give it each video's first frame).
        condition_folders: pipeline folders the conditions need beyond the VAE, with ``(model config) ->
            whether needed`` (Wan2.1 I2V: ``image_encoder`` and ``image_processor``).
        latent_channels: ``(model config as a dict) -> channels of the latents`` the VAE gives it (FLUX
            packs 2x2 patches: a quarter of ``in_channels``; SD3 patchifies inside: its ``in_channels``);
            None: its ``out_channels`` (else ``in_channels``).
        first_frame_condition: the first latent frame may be given clean in place of the noisy one (Wan2.2
            TI2V: ``image_latents`` ``[B, C, 1, H, W]`` replace it, its tokens at timestep 0): training draws
            which samples (``diffusion.first_frame_ratio``) and leaves that frame out of their loss, sampling
            puts the image's latents back at the end, and an image is optional in ``generate``.
        last_frame: the conditions are of the first and the last frame (FLF2V): ``image_conditions`` takes
            ``last_image=`` (``generate --last-image``; the video's last frame in extract-features and training).
        timestep_tokens: ``(model config, timestep [B], latent shape, first_frame [B] or None) -> [B, S]``:
            the per-token timesteps the model takes (Wan2.2 TI2V); None: one timestep per sample.
        combine_guidance: ``(conditional velocity, unconditional velocity, scale) -> guided velocity`` in the
            latents' layout, as the pipeline combines them (Qwen-Image: true CFG rescaled to the conditional
            norm); None: ``uncond + scale (cond - uncond)``.
        materialize_tables: ``(model built on the meta device) -> None`` recomputes the tensors the model keeps
            outside its parameters and buffers (Qwen-Image's rotary tables), which the ranks' shards and rank
            0's buffers do not carry.
        skip_layers: ``(model config) -> blocks`` where the model's ``forward`` takes ``skip_layers`` (SD3), which
            skip-layer guidance (:class:`~mindspeed_mm.diffusion.sampler.SkipLayerGuidance`) needs; None: not supported.
        image_prompts: ``encode_prompts`` takes the batch's source images too (``images=`` a list of PIL images:
            Qwen-Image-Edit encodes the instruction with its image), and extract-features reads each record's
            ``condition_image`` as the source image (its ``path`` is the target).
    """

    architecture: str
    model_class: str
    fsdp_plan: tuple[str, ...]
    latent_dims: int
    model_inputs: Callable[..., dict[str, Any]]
    prediction: Callable[[Any, tuple[int, ...]], torch.Tensor]
    tokens: Callable[[Any, tuple[int, ...]], int]
    tiny_config: dict[str, Any]
    text_len: int = 512
    needs_pooled: bool = False
    fp32_inputs: tuple[str, ...] = ("timestep",)
    parts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    timestep_divisor: float = 1.0
    scheduler: tuple[str, dict[str, Any]] = ("FlowMatchEulerDiscreteScheduler", {})
    timestep_kwargs: Callable[[Any, int, tuple[int, ...]], dict[str, Any]] = lambda config, steps, shape: {}
    encode_prompts: Callable[[dict[str, Any], list[str], int], tuple[torch.Tensor, torch.Tensor | None]] | None = None
    encode_options: tuple[str, ...] = ()
    sequence_plan: SequencePlan | None = None
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    variant: str = ""
    select_variant: Callable[[dict[str, Any]], str] | None = None
    conditions: tuple[tuple[str, Callable[[Any], bool]], ...] = ()
    image_conditions: Callable[[dict[str, Any], Any, int, int, int], dict[str, torch.Tensor]] | None = None
    condition_folders: tuple[tuple[str, Callable[[Any], bool]], ...] = ()
    latent_channels: Callable[[Any], int] | None = None
    first_frame_condition: bool = False
    last_frame: bool = False
    timestep_tokens: Callable[[Any, torch.Tensor, tuple[int, ...], torch.Tensor | None], torch.Tensor] | None = None
    combine_guidance: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    materialize_tables: Callable[[Any], None] | None = None
    skip_layers: Callable[[Any], int] | None = None
    image_prompts: bool = False

    @property
    def key(self) -> str:
        """The registry key: ``architecture``, or ``architecture:variant``."""
        return f"{self.architecture}:{self.variant}" if self.variant else self.architecture

    def condition_keys(self, config: Any) -> tuple[str, ...]:
        """The conditions a model of ``config`` takes."""
        return tuple(name for name, used in self.conditions if used(config))

    def load_class(self) -> type:
        """The diffusers model class."""
        module, name = self.model_class.split(":")
        return getattr(importlib.import_module(module), name)


#: ``_class_name`` -> family (each family's module imported when its name is first looked up).
DIT_FAMILIES: ManifestRegistry[DiTFamily] = ManifestRegistry("diffusion transformer family", DIT_MODULES)


def register_dit(family: DiTFamily) -> DiTFamily:
    """Add ``family`` to :data:`DIT_FAMILIES` under its :attr:`~DiTFamily.key`."""
    DIT_FAMILIES.register(family.key, family)
    return family


def dit_family_of(path: str | Path) -> DiTFamily:
    """The family of the diffusers directory ``path``, from its config.json's ``_class_name`` (and the
    variant the class's family selects from the rest of the config).

    Raises:
        ValueError: no config.json, no ``_class_name``, or a class not registered.
    """
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(
            f"{str(path)!r} has no config.json; give a local diffusers model directory (the "
            "transformer folder of a pipeline)"
        )
    values = json.loads(config.read_text())
    name = values.get("_class_name")
    if not name:
        raise ValueError(f"{config} has no `_class_name`; give a diffusers transformer directory")
    family = DIT_FAMILIES.get(name)
    index = Path(path).parent / "model_index.json"  # the pipeline's settings (Wan2.2 TI2V: expand_timesteps)
    if index.is_file():
        values["_pipeline"] = json.loads(index.read_text())
    variant = family.select_variant(values) if family.select_variant is not None else ""
    return DIT_FAMILIES.get(f"{name}:{variant}") if variant else family


def load_dit(path: str | Path, family: DiTFamily) -> Any:
    """The family's model with the weights of ``path``, in fp32 (the master copy FSDP2 shards)."""
    return family.load_class().from_pretrained(str(path), torch_dtype=torch.float32, local_files_only=True)


def build_meta_dit(path: str | Path, family: DiTFamily) -> Any:
    """The family's model with the configuration of ``path`` on the meta device (no memory, no weights)."""
    cls = family.load_class()
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(path)))
    if family.materialize_tables is not None:
        family.materialize_tables(model)
    return model


def write_tiny_dit(directory: str | Path, architecture: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random model of the family ``architecture`` (a registry key, :attr:`DiTFamily.key`) in
    diffusers' ``save_pretrained`` layout into ``directory``."""
    family = DIT_FAMILIES.get(architecture)
    torch.manual_seed(seed)
    model = family.load_class()(**{**family.tiny_config, **overrides})
    model.save_pretrained(str(directory))
    return Path(directory)
