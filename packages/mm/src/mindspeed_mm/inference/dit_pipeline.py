"""Loading what sampling a diffusion transformer needs: the transformer, its VAE, text encoders and scheduler.

``load_dir`` is one of:

- a diffusers pipeline directory (``model_index.json`` with ``transformer/``, ``vae/``, text
  encoders and tokenizers, ``scheduler/``);
- a transformer directory (``config.json`` with ``_class_name``: a pipeline's ``transformer``
  folder, or the trainer's ``checkpoint.save_hf`` export); the rest of the pipeline comes from
  ``pipeline_dir``, by default the directory's parent when that is a pipeline;
- a ``mindspeed-mm train`` checkpoint (torch DCP: ``SAVE/step_00000150``, or ``SAVE`` for its
  newest step), weights only: ``base_dir`` names the transformer (or pipeline) directory it
  was trained from, whose config builds the model; the checkpoint's tensors must match it exactly
  (a LoRA run's factors are merged into ``base_dir``'s weights; a ``train.ema`` run's gives its
  moving averages; a Wan2.2 ``diffusion.expert=both`` run's holds both experts: ``base_dir`` is the
  pipeline's ``transformer`` folder, whose sibling ``transformer_2`` and ``boundary_ratio`` complete the pair);
- a demo name (:data:`mindspeed_mm.demos.names.DEMOS`), resolved by ``generate`` before it calls this module
  (:func:`mindspeed_mm.demos.names.resolve_demo_dir`): the embedded demo's untrained pipeline.
"""

from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_mm.config import MMLoraConfig
from mindspeed_mm.convert.dcp_io import DCPModel
from mindspeed_mm.models.dit import DiTFamily, dit_family_of, load_dit
from mindspeed_mm.models.lora import (
    ADAPTER_CONFIG,
    adapted_modules,
    factor_names,
    is_factor,
    merged_state,
    recorded_lora_alpha,
)
from mindspeed_mm.models.wan_experts import EXPERT_FOLDERS, pipeline_boundary_ratio, second_expert_path
from mindspeed_mm.trainer.checkpoint import newest_checkpoint

logger = get_logger(__name__)

MODEL_INDEX = "model_index.json"
_DCP_METADATA = ".metadata"


@dataclass
class DiTPipeline:
    """A transformer ready to sample, with the parts of its pipeline.

    Attributes:
        family: the transformer's family.
        model: the diffusers transformer (eval mode, on ``device``).
        parts: the pipeline's other components by folder name (``vae``, ``text_encoder``, ``tokenizer``, ...).
        pipeline_dir: the pipeline directory the parts and the scheduler came from (None: none).
        weights: where the transformer's weights came from.
        device: the device the models are on.
        second: a Wan2.2 pair's training checkpoint (``diffusion.expert=both``): ``(transformer_2, boundary_ratio)``
            read from it with the first expert (None: :func:`load_second_expert` looks beside the weights).
    """

    family: DiTFamily
    model: Any
    parts: dict[str, Any]
    pipeline_dir: Path | None
    weights: Path
    device: torch.device
    second: tuple[Any, float] | None = None


def transformer_dir(path: Path) -> Path | None:
    """The transformer directory of ``path`` (a pipeline or a transformer directory), else None."""
    if (path / MODEL_INDEX).is_file() and (path / "transformer" / "config.json").is_file():
        return path / "transformer"
    config = path / "config.json"
    if config.is_file() and "_class_name" in json.loads(config.read_text()):
        return path
    return None


def is_dit_source(load_dir: str | Path, base_dir: str | Path | None = None) -> bool:
    """Whether ``generate`` should sample a diffusion transformer for these ``--load-dir`` / ``--base-dir``."""
    return any(p is not None and transformer_dir(Path(p)) is not None for p in (load_dir, base_dir))


def _resolve(path: str | Path) -> Path:
    # Demo names (mindspeed_mm.demos.names.DEMOS) are resolved by the caller: the demo builds on this module.
    return Path(path)


def _pipeline_of(transformer: Path, given: str | Path | None) -> Path | None:
    if given is not None:
        path = _resolve(given)
        if not (path / MODEL_INDEX).is_file():
            raise ValueError(f"--pipeline-dir {str(given)!r} has no {MODEL_INDEX}; give a diffusers pipeline directory")
        return path
    return transformer.parent if (transformer.parent / MODEL_INDEX).is_file() else None


def load_dit_pipeline(
    load_dir: str | Path,
    base_dir: str | Path | None = None,
    pipeline_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    ema: bool = True,
    lora_alpha: float | None = None,
) -> DiTPipeline:
    """The transformer of ``load_dir`` (see the module docstring) and its pipeline's parts.

    ``ema`` and ``lora_alpha`` apply to a training checkpoint (:func:`_load_dcp_models`).

    Raises:
        ValueError: a path that is none of the formats, a DCP checkpoint without ``base_dir`` or
            whose tensors do not match its model, a pipeline without a VAE or the family's text encoders.
    """
    load = _resolve(load_dir)
    source = transformer_dir(load)
    checkpoint = None
    if source is None:
        checkpoint = load if (load / _DCP_METADATA).is_file() else newest_checkpoint(load)
        if checkpoint is None or not (checkpoint / _DCP_METADATA).is_file():
            raise ValueError(
                f"--load-dir {str(load_dir)!r} is neither a diffusers pipeline ({MODEL_INDEX}), a "
                "transformer directory (config.json with _class_name) nor a training checkpoint; give one"
            )
        if base_dir is None:
            raise ValueError(
                f"--load-dir {str(load_dir)!r} is a training checkpoint (torch DCP, weights only); pass "
                "--base-dir with the transformer directory it was trained from (the recipe's model.path)"
            )
        source = transformer_dir(_resolve(base_dir))
        if source is None:
            raise ValueError(f"--base-dir {str(base_dir)!r} is not a diffusers transformer or pipeline directory")
    family = dit_family_of(source)
    device = get_accelerator().device()
    second = None
    if checkpoint is not None:
        models = _load_dcp_models(checkpoint, source, family, ema, lora_alpha)
        model = models[0]
        if len(models) == 2:
            ratio = pipeline_boundary_ratio(source)
            if ratio is None:
                raise ValueError(
                    f"{checkpoint} holds a Wan2.2 expert pair and {source.parent}/{MODEL_INDEX} records no "
                    "boundary_ratio; give --base-dir as the transformer folder of the run's pipeline"
                )
            second = (_to(models[1], device, dtype).eval(), float(ratio))
    else:
        model = family.load_class().from_pretrained(str(source), torch_dtype=torch.float32, local_files_only=True)
    model = _to(model, device, dtype).eval()
    pipeline = _pipeline_of(source, pipeline_dir)
    parts = load_parts(pipeline, family, device, dtype) if pipeline is not None else {}
    weights = checkpoint or source
    logger.info(
        "loaded %s from %s (%.2f M parameters, %s) with the pipeline %s on %s",
        family.architecture,
        weights,
        sum(p.numel() for p in model.parameters()) / 1e6,
        dtype,
        pipeline,
        device,
    )
    return DiTPipeline(family, model, parts, pipeline, weights, device, second)


def load_second_expert(loaded: DiTPipeline, dtype: torch.dtype) -> tuple[Any, float | None]:
    """Wan2.2's low-noise expert and ``boundary_ratio`` when ``loaded`` is a two-expert pipeline's ``transformer``.

    The pipeline's ``transformer_2`` is used only when the sampled weights are its own ``transformer``
    folder (a trained single transformer sampled with a Wan2.2 pipeline's parts stays alone).

    Returns:
        ``(transformer_2, boundary_ratio)``, or ``(None, None)``.
    """
    if loaded.second is not None:
        return loaded.second
    pipeline = loaded.pipeline_dir
    if pipeline is None or Path(loaded.weights) != pipeline / "transformer":
        return None, None
    ratio = json.loads((pipeline / MODEL_INDEX).read_text()).get("boundary_ratio")
    second = pipeline / "transformer_2"
    if ratio is None or not (second / "config.json").is_file():
        return None, None
    model = loaded.family.load_class().from_pretrained(str(second), torch_dtype=torch.float32, local_files_only=True)
    logger.info("loaded the low-noise expert from %s (boundary_ratio %s)", second, ratio)
    return _to(model, loaded.device, dtype).eval(), float(ratio)


def load_parts(pipeline: Path, family: DiTFamily, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The components of a pipeline directory other than its transformer(s) and scheduler, by folder name."""
    index = json.loads((pipeline / MODEL_INDEX).read_text())
    parts = {}
    for name, spec in index.items():
        if name.startswith("_") or name.startswith("transformer") or name == "scheduler":
            continue
        if not isinstance(spec, list) or spec[0] is None or not (pipeline / name).is_dir():
            continue
        cls = getattr(importlib.import_module(spec[0]), spec[1])
        part = cls.from_pretrained(str(pipeline / name), local_files_only=True)
        if isinstance(part, torch.nn.Module):
            part = _to(part, device, dtype).eval()
        parts[name] = part
    if "vae" not in parts:
        raise ValueError(f"{pipeline}/{MODEL_INDEX} lists no vae; give a complete diffusers pipeline directory")
    return parts


def _to(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    # .to(float32) of a diffusers model logs a warning about its fp32 modules: only cast when asked to.
    return module.to(device) if dtype == torch.float32 else module.to(device=device, dtype=dtype)


def _load_dcp(
    checkpoint: Path, source: Path, family: DiTFamily, ema: bool = True, lora_alpha: float | None = None
) -> Any:
    """The (first) model of :func:`_load_dcp_models`."""
    return _load_dcp_models(checkpoint, source, family, ema, lora_alpha)[0]


def _load_dcp_models(
    checkpoint: Path, source: Path, family: DiTFamily, ema: bool = True, lora_alpha: float | None = None
) -> list[Any]:
    """The model of ``source``'s config with the weights of the DCP checkpoint (strict: names and shapes match);
    a Wan2.2 pair's checkpoint (``transformer.`` and ``transformer_2.`` tensors) gives both experts, the second
    of the config beside ``source``.

    A ``train.ema`` run's checkpoint gives the moving averages of its trained weights unless ``ema``
    is false; a LoRA run's has its factors merged (``W + alpha / r B A``, alpha as the run recorded
    it beside its checkpoints, or ``lora_alpha``).
    """
    reader = DCPModel(checkpoint, ema=ema)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        saved = reader.read(sorted(reader.tensors))
    if reader.ema_names:
        logger.info("%s: the moving averages of %d trained tensors (train.ema)", checkpoint, len(reader.ema_names))
    if {name.split(".", 1)[0] for name in saved} != set(EXPERT_FOLDERS):
        return [_model_of(saved, checkpoint, source, family, lora_alpha)]
    sources = (source, second_expert_path(source))
    models = []
    for folder, folder_source in zip(EXPERT_FOLDERS, sources):
        part = {k[len(folder) + 1 :]: v for k, v in saved.items() if k.startswith(folder + ".")}
        models.append(_model_of(part, checkpoint, folder_source, family, lora_alpha))
    logger.info("%s: a Wan2.2 expert pair (%s and %s)", checkpoint, *sources)
    return models


def _model_of(
    saved: dict[str, torch.Tensor], checkpoint: Path, source: Path, family: DiTFamily, lora_alpha: float | None
) -> Any:
    """``source``'s model holding ``saved`` (a LoRA run's factors merged)."""
    adapted = adapted_modules(saved)
    if adapted:
        alpha = recorded_lora_alpha(checkpoint, lora_alpha)
        if alpha is None:
            raise ValueError(
                f"{checkpoint} is a LoRA run's checkpoint ({len(adapted)} adapted linears) and no "
                f"{ADAPTER_CONFIG} beside it records alpha; pass --lora-alpha with the recipe's lora.alpha"
            )
        rank = int(saved[factor_names(adapted[0])[0]].shape[0])
        if all(is_factor(name) for name in saved):  # the factors alone: the base is the run's model.path
            saved = {**_base_state(source, family, set(adapted)), **saved}
        saved = merged_state(saved, MMLoraConfig(r=rank, alpha=alpha))
    cls = family.load_class()
    model = cls.from_config(cls.load_config(str(source)))  # not on meta: non-persistent buffers (rope) need values
    state = model.state_dict()
    missing, unexpected = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    wrong = [name for name in set(state) & set(saved) if tuple(state[name].shape) != tuple(saved[name].shape)]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{checkpoint}: its model tensors do not match {source}'s {family.architecture} (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}, other shapes {wrong[:3]}); pass the "
            "--base-dir the run trained from"
        )
    model.load_state_dict(saved, strict=True)
    return model.float()


def _base_state(source: Path, family: DiTFamily, adapted: set[str]) -> dict[str, torch.Tensor]:
    """``source``'s weights under a LoRA model's names (``P.base_layer.weight`` where ``P`` is adapted)."""
    base = load_dit(source, family).state_dict()
    state = {}
    for name, value in base.items():
        prefix, _, leaf = name.rpartition(".")
        state[f"{prefix}.base_layer.{leaf}" if prefix in adapted else name] = value
    return state


def latent_shape(vae: Any, family: DiTFamily, num_frames: int, height: int, width: int) -> tuple[int, ...]:
    """One sample's latent shape for a video (``num_frames``) or image of ``height x width`` pixels.

    Raises:
        ValueError: sizes the VAE's (and the transformer's patch) strides do not divide.
    """
    config = vae.config
    temporal = getattr(config, "temperal_downsample", None)
    if temporal is not None:  # AutoencoderKLWan: 2x per downsampling level, 2x in time where marked
        # (the Wan2.2 VAE folds patch_size x patch_size pixels into channels first: 16x in space)
        spatial = 2 ** len(temporal) * (getattr(config, "patch_size", None) or 1)
        time = 2 ** sum(bool(t) for t in temporal)
        channels = config.z_dim
    elif getattr(config, "block_out_channels", None) is not None:  # AutoencoderKL: 2x per level after the first
        spatial, time, channels = 2 ** (len(config.block_out_channels) - 1), 1, config.latent_channels
    else:  # the demo's PatchVAE
        spatial, time, channels = config.patch_size, 1, vae.latent_channels
    multiple = spatial * 2
    if height % multiple or width % multiple:
        raise ValueError(
            f"--height {height} and --width {width} must be multiples of {multiple} (the VAE's stride "
            f"{spatial} times the transformer's patch 2)"
        )
    if family.latent_dims == 3:
        return channels, height // spatial, width // spatial
    if (num_frames - 1) % time:
        raise ValueError(
            f"--num-frames {num_frames}: frames - 1 must be a multiple of the VAE's temporal stride {time}"
        )
    return channels, (num_frames - 1) // time + 1, height // spatial, width // spatial
