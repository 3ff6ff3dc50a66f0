"""Sampling a diffusion transformer: diffusers' flow-matching schedulers, classifier-free guidance, decoding.

The loop is the one ``WanPipeline`` and ``FluxPipeline`` run, written once over the family
description (:class:`~mindspeed_mm.models.dit.DiTFamily`), so that the same code serves every
family and sequence-parallel sampling (a model under
:func:`~mindspeed_mm.models.dit_parallel.apply_sequence_parallel` returns the whole prediction on every rank):

1. ``scheduler.set_timesteps(steps, **family.timestep_kwargs(...))`` (FLUX: its sigmas and ``mu``);
2. per timestep ``t``: the model's velocity for the text, and with guidance (``guidance_scale > 1``
   and a negative text) for the negative text, combined as ``uncond + g (cond - uncond)`` (or as the
   family's ``combine_guidance`` says: Qwen-Image's norm-rescaled true CFG); with skip-layer guidance
   (:class:`SkipLayerGuidance`, SD3.5's: a family with ``skip_layers``) a third call for the text with the
   given blocks skipped, added as ``+ s_slg (cond - skipped)`` on the steps ``StableDiffusion3Pipeline``
   applies it to;
3. ``scheduler.step``; the model sees ``t / family.timestep_divisor`` (Wan ``t``, FLUX ``t / 1000``).

The schedulers are diffusers' own: Euler (``FlowMatchEulerDiscreteScheduler``) and UniPC
(``UniPCMultistepScheduler`` with ``prediction_type=flow_prediction, use_flow_sigmas=True``, as
Wan's pipelines ship it). :func:`decode_latents` un-normalises the latents as the pipelines do and
runs the VAE's decoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models.dit import DiTFamily

#: ``--sampler`` name -> diffusers scheduler class.
SAMPLERS = {"euler": "FlowMatchEulerDiscreteScheduler", "unipc": "UniPCMultistepScheduler"}
#: UniPC in flow mode, as Wan's diffusers pipelines and MindSpeed-MM's Wan inference recipes configure it.
UNIPC_FLOW = {
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "solver_order": 2,
    "solver_type": "bh2",
    "final_sigmas_type": "zero",
}


@dataclass(frozen=True)
class SkipLayerGuidance:
    """Skip-layer guidance as ``StableDiffusion3Pipeline.__call__`` runs it (its ``skip_guidance_layers`` and
    ``skip_layer_guidance_scale / _start / _stop``, the same defaults).

    On step ``i`` of ``N`` with ``start x N < i < stop x N`` (strictly, as the pipeline compares), the guided
    velocity gains ``scale x (cond - skipped)``, ``skipped`` the model's velocity for the text with the
    ``layers`` blocks left out (the transformer's ``skip_layers``). Only with classifier-free guidance.

    Attributes:
        layers: indices of the blocks skipped (SD3.5 Medium's recommended ``(7, 8, 9)``).
        scale: the guidance scale of the skipped-layer prediction.
        start: the fraction of the steps after which it applies.
        stop: the fraction of the steps before which it applies.
    """

    layers: tuple[int, ...]
    scale: float = 2.8
    start: float = 0.01
    stop: float = 0.2

    def applies(self, step: int, steps: int) -> bool:
        """Whether step ``step`` (0-based) of ``steps`` is guided with the skipped layers."""
        return steps * self.start < step < steps * self.stop

    def check(self, family: DiTFamily, model: Any, guided: bool) -> None:
        """Raise a one-line ValueError where ``family`` / ``model`` cannot take it or guidance is off."""
        if family.skip_layers is None:
            raise ValueError(
                f"--skip-guidance-layers: {family.key} has no skip-layer guidance (SD3 / SD3.5's transformer "
                "takes skip_layers); remove --skip-guidance-layers"
            )
        blocks = family.skip_layers(model.config)
        wrong = [layer for layer in self.layers if not 0 <= layer < blocks]
        if wrong or not self.layers:
            raise ValueError(
                f"--skip-guidance-layers {','.join(map(str, self.layers))}: the model has {blocks} blocks; give "
                f"comma-separated indices from 0 to {blocks - 1}"
            )
        if not guided:
            raise ValueError(
                "--skip-guidance-layers adds to classifier-free guidance; give --guidance-scale above 1 (and a "
                "negative text), or remove --skip-guidance-layers"
            )


def scheduler_config(family: DiTFamily, pipeline_dir: str | Path | None) -> tuple[str, dict[str, Any]]:
    """``(class name, config)``: the pipeline directory's ``scheduler/scheduler_config.json``, else the family's."""
    path = Path(pipeline_dir) / "scheduler" / "scheduler_config.json" if pipeline_dir is not None else None
    if path is None or not path.is_file():
        return family.scheduler[0], dict(family.scheduler[1])
    config = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_") or k == "_class_name"}
    return config.pop("_class_name"), config


def build_scheduler(
    family: DiTFamily,
    pipeline_dir: str | Path | None = None,
    sampler: str | None = None,
    flow_shift: float | None = None,
) -> Any:
    """The sampling scheduler.

    Args:
        family: the model's family (its default scheduler when the pipeline has none).
        pipeline_dir: a diffusers pipeline directory whose ``scheduler`` folder is used as it is.
        sampler: ``euler`` or ``unipc`` to switch the class (keeping the shift), None to keep it.
        flow_shift: a fixed shift of the sigmas (replaces the config's, and FLUX's resolution-dependent one).

    Raises:
        ValueError: an unknown sampler, or a pipeline scheduler that is not a flow-matching one of these.
    """
    import diffusers

    if sampler is not None and sampler not in SAMPLERS:
        raise ValueError(f"--sampler {sampler!r} is unknown; use one of {', '.join(SAMPLERS)}")
    name, config = scheduler_config(family, pipeline_dir)
    if name not in SAMPLERS.values():
        raise ValueError(
            f"{pipeline_dir}/scheduler is a {name}; give --sampler {' or '.join(SAMPLERS)} (flow-matching schedulers)"
        )
    target = SAMPLERS[sampler] if sampler is not None else name
    shift = flow_shift if flow_shift is not None else config.get("flow_shift", config.get("shift", 1.0))
    if target != name:  # another class: keep what both understand
        config = {"num_train_timesteps": config.get("num_train_timesteps", 1000)}
    if target == SAMPLERS["unipc"]:
        config = {**UNIPC_FLOW, **config, "flow_shift": shift}
    else:
        config = {**config, "shift": shift}
        if flow_shift is not None:
            config["use_dynamic_shifting"] = False
    return getattr(diffusers, target).from_config(config)


@torch.no_grad()
def sample_latents(
    model: Any,
    family: DiTFamily,
    scheduler: Any,
    latents: torch.Tensor,
    text: torch.Tensor,
    steps: int,
    pooled: torch.Tensor | None = None,
    negative_text: torch.Tensor | None = None,
    negative_pooled: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    distilled_guidance: float = 1.0,
    model_2: Any = None,
    boundary_ratio: float | None = None,
    guidance_scale_2: float | None = None,
    conditions: dict[str, torch.Tensor] | None = None,
    skip_guidance: SkipLayerGuidance | None = None,
) -> torch.Tensor:
    """Denoise ``latents`` (pure noise, ``[B, ...]`` in the family's latent layout) into clean latents.

    Args:
        model: the diffusers transformer (eval mode).
        family: its family.
        scheduler: a diffusers flow-matching scheduler (:func:`build_scheduler`).
        latents: the initial noise (float32, as the pipelines keep the latents).
        text: text embeddings ``[B, L, D]`` as the model was trained with (Wan: zero-padded).
        steps: inference steps.
        pooled: pooled text embeddings ``[B, P]`` (FLUX).
        negative_text: the negative prompt's embeddings (guidance when ``guidance_scale > 1``).
        negative_pooled: the negative prompt's pooled embeddings (FLUX).
        guidance_scale: classifier-free guidance (Wan's ``guidance_scale``, FLUX's ``true_cfg_scale``).
        distilled_guidance: the guidance value given to a guidance-distilled model (FLUX.1-dev's
            ``guidance_scale``); ignored by models without a guidance embedding.
        model_2: Wan2.2's low-noise expert (``WanPipeline``'s ``transformer_2``): it denoises the timesteps
            below ``boundary_ratio x num_train_timesteps``, ``model`` those at or above.
        boundary_ratio: the experts' switch (required with ``model_2``).
        guidance_scale_2: the guidance of ``model_2``'s steps (None: ``guidance_scale``); guidance is on
            for both experts when ``guidance_scale > 1``, as in ``WanPipeline``.
        conditions: the family's conditions ``[B, ...]`` by name (Wan I2V: the first frame's
            ``image_latents`` and ``image_embeds``), the same for the guided and the unguided call, as
            ``WanImageToVideoPipeline`` gives them. Wan2.2 TI2V (``first_frame_condition``): the image's
            ``image_latents`` ``[B, C, 1, H, W]`` are the model input's first frame at timestep 0 and the
            result's first frame; without them it samples text-to-video with per-token timesteps.
        skip_guidance: skip-layer guidance on top of classifier-free guidance (SD3.5; :class:`SkipLayerGuidance`).

    Raises:
        ValueError: a second expert without ``boundary_ratio``; skip-layer guidance for a family without
            ``skip_layers``, with a block index out of range, or without classifier-free guidance.
    """
    shape = tuple(latents.shape)
    scheduler.set_timesteps(steps, device=latents.device, **family.timestep_kwargs(scheduler.config, steps, shape))
    scheduler.set_begin_index(0)
    dtype = next(model.parameters()).dtype
    guided = guidance_scale > 1.0 and negative_text is not None
    if model_2 is not None and boundary_ratio is None:
        raise ValueError("a second expert (transformer_2) needs boundary_ratio; give --boundary-ratio")
    if skip_guidance is not None:
        skip_guidance.check(family, model, guided)
    boundary = boundary_ratio * scheduler.config.num_train_timesteps if model_2 is not None else None
    scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
    conditions = {key: value.to(latents.device, dtype) for key, value in (conditions or {}).items()}
    for step, t in enumerate(scheduler.timesteps):
        low = boundary is not None and t < boundary  # WanPipeline: t >= boundary runs `transformer`
        current, scale = (model_2, scale_2) if low else (model, guidance_scale)
        timestep = t.expand(shape[0]).to(torch.float32) / family.timestep_divisor
        velocity = _velocity(current, family, latents.to(dtype), timestep, text, pooled, distilled_guidance, conditions)
        conditional = velocity
        if guided:
            uncond = _velocity(
                current,
                family,
                latents.to(dtype),
                timestep,
                negative_text,
                negative_pooled,
                distilled_guidance,
                conditions,
            )
            if family.combine_guidance is not None:
                velocity = family.combine_guidance(velocity, uncond, scale)
            else:
                velocity = uncond + scale * (velocity - uncond)
            if skip_guidance is not None and skip_guidance.applies(step, steps):
                skipped = _velocity(
                    current,
                    family,
                    latents.to(dtype),
                    timestep,
                    text,
                    pooled,
                    distilled_guidance,
                    conditions,
                    skip_layers=list(skip_guidance.layers),
                )
                velocity = velocity + skip_guidance.scale * (conditional - skipped)
        latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    if family.first_frame_condition and "image_latents" in conditions:  # WanImageToVideoPipeline (TI2V)
        latents = torch.cat([conditions["image_latents"].to(latents.dtype), latents[:, :, 1:]], dim=2)
    return latents


def _velocity(
    model: Any,
    family: DiTFamily,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: float,
    conditions: dict[str, torch.Tensor],
    skip_layers: list[int] | None = None,
) -> torch.Tensor:
    dtype = latents.dtype
    pooled = pooled.to(dtype) if pooled is not None else None
    inputs = family.model_inputs(model.config, latents, timestep, text.to(dtype), pooled, guidance, **conditions)
    inputs["timestep"] = timestep
    if skip_layers is not None:
        inputs["skip_layers"] = skip_layers
    if family.timestep_tokens is not None:  # Wan2.2 TI2V: per token, 0 on a given first frame
        first_frame = torch.ones(latents.shape[0], dtype=torch.bool) if "image_latents" in conditions else None
        inputs["timestep"] = family.timestep_tokens(model.config, timestep, tuple(latents.shape), first_frame)
    return family.prediction(model(**inputs), tuple(latents.shape))


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1] of normalised ``latents``: ``[B, F, 3, H, W]`` for video, ``[B, 3, H, W]`` for images.

    The inverse of :func:`mindspeed_mm.models.encoders.encode_latents` followed by the VAE's
    decoder, with the pipelines' arithmetic (Wan: ``z / (1 / std) + mean``; ``AutoencoderKL``:
    ``z / scaling_factor + shift_factor``) and their post-processing (``x / 2 + 0.5`` clamped); image
    latents of a causal 3-D VAE (Qwen-Image's) are decoded as one frame, as ``QwenImagePipeline`` does.
    """
    config = vae.config
    dtype = next(vae.parameters()).dtype
    latents = latents.to(dtype)
    if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
        view = (1, -1) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(config.latents_mean).view(view).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(view).to(latents.device, latents.dtype)
        latents = latents / inverse_std + mean
    else:
        latents = latents / config.scaling_factor + (getattr(config, "shift_factor", None) or 0.0)
    frames = latents.ndim == 4 and getattr(config, "temperal_downsample", None) is not None  # Qwen-Image's VAE
    pixels = vae.decode(latents[:, :, None] if frames else latents, return_dict=False)[0]
    pixels = pixels[:, :, 0] if frames else pixels
    pixels = (pixels * 0.5 + 0.5).clamp(0, 1)
    return pixels.transpose(1, 2) if pixels.ndim == 5 else pixels


@torch.no_grad()
def decode_shared(vae: Any, latents: torch.Tensor, group: Any = None, dst: int = 0) -> torch.Tensor | None:
    """:func:`decode_latents` of ``latents`` ``[N, ...]`` with the work split over the ranks of ``group``.

    Every rank holds all the latents (sequence-parallel sampling returns them on each); rank ``r`` of
    ``G`` decodes samples ``r, r + G, ...`` one at a time, and group rank ``dst`` receives the pixels
    of all (on the CPU, in order). One sample is not split: with fewer samples than ranks some ranks
    have nothing to decode. Without a group, or in a one-rank group, this is :func:`decode_latents`.

    Returns:
        The pixels on group rank ``dst``, None on the other ranks.
    """
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return decode_latents(vae, latents)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = {i: decode_latents(vae, latents[i : i + 1])[0].cpu() for i in range(rank, latents.shape[0], size)}
    parts: list[Any] | None = [None] * size if rank == dst else None
    dist.gather_object(mine, parts, dst=dist.get_global_rank(group, dst), group=group)
    if parts is None:
        return None
    merged = {index: pixels for part in parts for index, pixels in part.items()}
    return torch.stack([merged[i] for i in range(latents.shape[0])])
