"""Loading a vision-language model for inference: from a Hugging Face directory or a training checkpoint.

``load_dir`` is one of:

- a Hugging Face directory (config.json with ``architectures``, weights, tokenizer, image
  processor, chat template), e.g. the trainer's ``checkpoint.save_hf`` export;
- a training checkpoint of ``mindspeed-mm train`` (torch DCP: ``SAVE/step_00000150``), or the
  ``checkpoint.save`` folder itself (its newest complete step is taken). A DCP checkpoint holds
  weights only, so ``base_dir`` names the Hugging Face directory it was trained from (config,
  tokenizer, image processor); the checkpoint's model tensors must match that model's exactly.
  A LoRA run's checkpoint holds the factors alone (older ones the base weights too; else the
  base is ``base_dir``'s): they are merged
  (``W + alpha / r * B A``, :func:`mindspeed_mm.models.lora.merged_state`) with the alpha the run
  recorded in ``adapter_config.json`` next to its checkpoints (DCP records the rank, not alpha),
  or ``lora_alpha`` (the recipe's ``lora.alpha``) for a checkpoint moved away from it;
- a PEFT LoRA adapter directory (``adapter_config.json``, e.g. a run's ``lora.save_peft``),
  merged into its base model: ``base_dir``, else the adapter's ``base_model_name_or_path``;
- ``demo`` is resolved by the caller (``generate``, ``evaluate``: :mod:`mindspeed_mm.demos.names`): the
  embedded demo's untrained model.

The model is the family's transformers class (the registry :data:`~mindspeed_mm.models.FAMILIES`),
in eval mode on the accelerator of :func:`mindspeed.device.get_accelerator`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from mindspeed.checkpointing.trust import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_mm.config import MMLoraConfig
from mindspeed_mm.data.video import VideoSettings
from mindspeed_mm.models import family_of, load_audio_processor, load_processing, load_video_processor
from mindspeed_mm.models.family import VLMFamily
from mindspeed_mm.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapted_modules,
    is_factor,
    merge_weight,
    merged_state,
    recorded_lora_alpha,
)
from mindspeed_mm.models.peft_io import read_peft_adapter
from mindspeed_mm.trainer.checkpoint import newest_checkpoint

logger = get_logger(__name__)

#: ``--dtype`` names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DCP_METADATA = ".metadata"


@dataclass
class InferenceModel:
    """A model ready to generate or score, with the processing it was trained with.

    Attributes:
        family: the registered family.
        model: the transformers model (eval mode, on ``device``).
        tokenizer: the tokenizer with its chat template.
        processor: the image processor.
        source: the Hugging Face directory of the config, tokenizer and image processor.
        weights: where the weights came from (the directory, or the DCP checkpoint).
        device: the device the model is on.
        video_settings: how videos are decoded (``--video-fps``, ``--video-maxlen``, pixel bounds).
    """

    family: VLMFamily
    model: Any
    tokenizer: Any
    processor: Any
    source: Path
    weights: Path
    device: torch.device
    video_settings: VideoSettings = VideoSettings()
    _video_processor: Any = None
    _audio_processor: Any = None

    def audio_processor(self) -> Any:
        """The audio feature extractor of :attr:`source` (loaded when first asked for).

        Raises:
            ValueError: the family takes no audio, or the directory has none.
        """
        if self._audio_processor is None:
            self._audio_processor = load_audio_processor(self.source)
        return self._audio_processor

    def video_processor(self) -> Any:
        """The video processor of :attr:`source` (loaded when first asked for; None: the family takes no videos)."""
        if self._video_processor is None and self.family.video_inputs is not None:
            self._video_processor = load_video_processor(self.source)
        return self._video_processor


def find_dcp_checkpoint(path: Path) -> Path | None:
    """The DCP checkpoint ``path`` is (a step folder) or holds (the newest step of a ``checkpoint.save`` folder)."""
    if (path / _DCP_METADATA).is_file():
        return path
    newest = newest_checkpoint(path)
    return newest if newest is not None and (newest / _DCP_METADATA).is_file() else None


def load_inference_model(
    load_dir: str | Path,
    base_dir: str | Path | None = None,
    dtype: str | None = None,
    min_pixels: int = 3136,
    max_pixels: int = 262144,
    lora_alpha: float | None = None,
    video_settings: VideoSettings | None = None,
) -> InferenceModel:
    """The model of ``load_dir`` (see the module docstring), its tokenizer and image processor.

    Args:
        load_dir: a Hugging Face directory, a DCP training checkpoint (or its save folder), or a PEFT adapter.
        base_dir: the Hugging Face directory of config, tokenizer and image processor (required for a
            DCP checkpoint; for a Hugging Face directory it replaces the directory's own processing files).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (default: the directory's dtype; float32 for DCP).
        min_pixels: images are resized to at least this many pixels.
        max_pixels: and to at most this many.
        lora_alpha: the LoRA scale numerator of a LoRA run's DCP checkpoint (the recipe's ``lora.alpha``).
        video_settings: how prompts' videos are decoded (default: ``VideoSettings()``, the recipe defaults).

    Raises:
        ValueError: a missing directory, a directory that is none of the formats, an unregistered
            family, a DCP checkpoint without ``base_dir`` or whose tensors do not match its model,
            a LoRA checkpoint without ``lora_alpha``, an adapter that is not plain LoRA.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    load = Path(load_dir)
    if not load.is_dir():
        raise ValueError(
            f"--load-dir {str(load_dir)!r} is not a directory; give a Hugging Face model directory, a "
            "mindspeed-mm training checkpoint (checkpoint.save or one of its step_* folders), a PEFT "
            "adapter, or demo"
        )
    adapter = (load / ADAPTER_CONFIG).is_file() and (load / ADAPTER_WEIGHTS).is_file()
    checkpoint = None if adapter or (load / "config.json").is_file() else find_dcp_checkpoint(load)
    if checkpoint is None and not adapter and not (load / "config.json").is_file():
        raise ValueError(
            f"--load-dir {str(load_dir)!r} has neither config.json (a Hugging Face directory), "
            "adapter_config.json (a PEFT adapter) nor a DCP checkpoint (.metadata, or step_* folders); "
            "give one of them"
        )
    if checkpoint is not None and base_dir is None:
        raise ValueError(
            f"--load-dir {str(load_dir)!r} is a training checkpoint (torch DCP, weights only); pass "
            "--base-dir with the Hugging Face directory it was trained from (model.path of the recipe)"
        )
    if adapter and base_dir is None:
        base_dir = json.loads((load / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if not base_dir:
            raise ValueError(
                f"{load / ADAPTER_CONFIG} names no base model; pass --base-dir with the model "
                "directory the adapter was trained on"
            )
    source = Path(base_dir) if base_dir is not None else load
    if not (source / "config.json").is_file():
        raise ValueError(
            f"--base-dir {str(base_dir)!r} has no config.json; give the Hugging Face directory the "
            "weights were trained from"
        )
    family = family_of(source)
    tokenizer, processor = load_processing(source, min_pixels, max_pixels)
    device = get_accelerator().device()
    weights = checkpoint or load
    if checkpoint is not None:
        model = _load_dcp(checkpoint, source, family, DTYPES[dtype or "float32"], lora_alpha)
    else:
        base = source if adapter else load  # an HF directory's weights are its own; an adapter's its base's
        model = family.load_class().from_pretrained(
            str(base), dtype=DTYPES[dtype] if dtype else "auto", local_files_only=True
        )
        if adapter:
            _merge_adapter(model, load)
    model = model.to(device).eval()
    logger.info(
        "loaded %s from %s (%s, %.2f M parameters) on %s",
        family.architecture,
        weights,
        next(model.parameters()).dtype,
        sum(p.numel() for p in model.parameters()) / 1e6,
        device,
    )
    return InferenceModel(
        video_settings=video_settings or VideoSettings(),
        family=family,
        model=model,
        tokenizer=tokenizer,
        processor=processor,
        source=source,
        weights=weights,
        device=device,
    )


def _load_dcp(checkpoint: Path, source: Path, family: VLMFamily, dtype: torch.dtype, lora_alpha: float | None) -> Any:
    """The model of ``source``'s config with the weights of the DCP checkpoint (strict: names and shapes must match)."""
    from transformers import AutoConfig

    metadata = read_dcp_metadata(checkpoint).state_dict_metadata  # nothing in it runs code
    saved = {}
    for key, meta in metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            saved[key[len("model.") :]] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(
            {"model": saved},
            storage_reader=SafeFileSystemReader(str(checkpoint)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    lora = adapted_modules(saved)
    if lora:
        lora_alpha = recorded_lora_alpha(checkpoint, lora_alpha)
        if lora_alpha is None:
            raise ValueError(
                f"{checkpoint} is a LoRA run's checkpoint ({len(lora)} adapted linears) and no "
                f"{ADAPTER_CONFIG} beside it records alpha; pass --lora-alpha with the recipe's lora.alpha"
            )
        settings = MMLoraConfig(r=int(saved[f"{lora[0]}.lora_A.default.weight"].shape[0]), alpha=lora_alpha)
        if all(is_factor(name) for name in saved):  # the factors alone: the base is the run's model.path
            saved = _over_base(saved, lora, source, family, checkpoint)
        saved = merged_state(saved, settings)
    config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    model = family.load_class()._from_config(config, dtype=torch.float32)
    state = model.state_dict()
    missing, unexpected = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint}: its model tensors do not match {source}'s {family.architecture} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); pass the --base-dir the run "
            "trained from"
        )
    for name, value in state.items():
        if saved[name].shape != value.shape:
            raise ValueError(
                f"{checkpoint}: {name} has shape {tuple(saved[name].shape)}, {source}'s model "
                f"{tuple(value.shape)}; pass the --base-dir the run trained from"
            )
    model.load_state_dict(saved)
    return model.to(dtype)


def _over_base(
    factors: dict[str, torch.Tensor], lora: list[str], source: Path, family: VLMFamily, checkpoint: Path
) -> dict[str, torch.Tensor]:
    """A LoRA run's full trained state: ``source``'s weights (``P.base_layer.*`` where adapted) and the factors."""
    base = family.load_class().from_pretrained(str(source), dtype=torch.float32, local_files_only=True).state_dict()
    unknown = [module for module in lora if f"{module}.weight" not in base]
    if unknown:
        raise ValueError(
            f"{checkpoint}: its LoRA factors adapt {unknown[0]}, which {source}'s model has no linear of "
            f"({len(unknown)} such); pass the --base-dir the run trained from"
        )
    adapted = set(lora)
    state = {}
    for name, value in base.items():
        prefix, _, leaf = name.rpartition(".")
        state[f"{prefix}.base_layer.{leaf}" if prefix in adapted else name] = value
    return {**state, **factors}


def _merge_adapter(model: Any, adapter_dir: Path) -> None:
    """Fold a PEFT LoRA adapter into ``model``'s weights (``W + alpha / r * B A`` in fp32, as peft merges)."""
    adapter = read_peft_adapter(adapter_dir)
    state = model.state_dict()
    unknown = [module for module in adapter.factors if f"{module}.weight" not in state]
    if unknown:
        raise ValueError(
            f"{adapter_dir}: the adapter adapts {unknown[0]}, which the base model has no linear of "
            f"({len(unknown)} such); pass the --base-dir the adapter was trained on"
        )
    with torch.no_grad():
        for module, (a, b) in adapter.factors.items():
            weight = state[f"{module}.weight"]
            weight.copy_(merge_weight(weight, a.to(weight.device), b.to(weight.device), adapter.settings.scale))
    logger.info(
        "merged the LoRA adapter %s (%d linears, r=%d, alpha=%g)",
        adapter_dir,
        len(adapter.factors),
        adapter.settings.r,
        adapter.settings.alpha,
    )
