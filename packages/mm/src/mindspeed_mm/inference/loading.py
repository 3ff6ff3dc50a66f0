"""Loading a vision-language model for inference: from a Hugging Face directory or a training checkpoint.

``load_dir`` is one of:

- a Hugging Face directory (config.json with ``architectures``, weights, tokenizer, image
  processor, chat template), e.g. the trainer's ``checkpoint.save_hf`` export;
- a training checkpoint of ``mindspeed-mm train`` (torch DCP: ``SAVE/step_00000150``), or the
  ``checkpoint.save`` folder itself (its newest complete step is taken). A DCP checkpoint holds
  weights only, so ``hf_cfg_dir`` names the Hugging Face directory it was trained from (config,
  tokenizer, image processor); the checkpoint's model tensors must match that model's exactly;
- ``demo``: the embedded demo's untrained model (``mindspeed_mm.demo``).

The model is the family's transformers class (the registry :data:`~mindspeed_mm.models.FAMILIES`),
in eval mode on the accelerator of :func:`mindspeed.device.get_accelerator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_mm.demo import DEMO, demo_paths
from mindspeed_mm.models import family_of, load_processing
from mindspeed_mm.models.family import VLMFamily
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
    """

    family: VLMFamily
    model: Any
    tokenizer: Any
    processor: Any
    source: Path
    weights: Path
    device: torch.device


def resolve_model_dir(path: str | Path) -> Path:
    """``demo`` -> the demo model's directory (written once); any other path as it is."""
    return demo_paths()["model"] if str(path) == DEMO else Path(path)


def find_dcp_checkpoint(path: Path) -> Path | None:
    """The DCP checkpoint ``path`` is (a step folder) or holds (the newest step of a ``checkpoint.save`` folder)."""
    if (path / _DCP_METADATA).is_file():
        return path
    newest = newest_checkpoint(path)
    return newest if newest is not None and (newest / _DCP_METADATA).is_file() else None


def load_inference_model(load_dir: str | Path, hf_cfg_dir: str | Path | None = None, dtype: str | None = None,
                         min_pixels: int = 3136, max_pixels: int = 262144) -> InferenceModel:
    """The model of ``load_dir`` (see the module docstring), its tokenizer and image processor.

    Args:
        load_dir: a Hugging Face directory, a DCP training checkpoint (or its save folder), or ``demo``.
        hf_cfg_dir: the Hugging Face directory of config, tokenizer and image processor (required for a
            DCP checkpoint; for a Hugging Face directory it replaces the directory's own processing files).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (default: the directory's dtype; float32 for DCP).
        min_pixels: images are resized to at least this many pixels.
        max_pixels: and to at most this many.

    Raises:
        ValueError: a missing directory, a directory that is neither format, an unregistered
            family, a DCP checkpoint without ``hf_cfg_dir`` or whose tensors do not match its model.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    load = resolve_model_dir(load_dir)
    if not load.is_dir():
        raise ValueError(f"--load-dir {str(load_dir)!r} is not a directory; give a Hugging Face model directory, a "
                         "mindspeed-mm training checkpoint (checkpoint.save or one of its step_* folders), or demo")
    checkpoint = None if (load / "config.json").is_file() else find_dcp_checkpoint(load)
    if checkpoint is None and not (load / "config.json").is_file():
        raise ValueError(f"--load-dir {str(load_dir)!r} has neither config.json (a Hugging Face directory) nor a DCP "
                         "checkpoint (.metadata, or step_* folders); give one of them")
    if checkpoint is not None and hf_cfg_dir is None:
        raise ValueError(f"--load-dir {str(load_dir)!r} is a training checkpoint (torch DCP, weights only); pass "
                         "--hf-cfg-dir with the Hugging Face directory it was trained from (model.path of the recipe)")
    source = resolve_model_dir(hf_cfg_dir) if hf_cfg_dir is not None else load
    if not (source / "config.json").is_file():
        raise ValueError(f"--hf-cfg-dir {str(hf_cfg_dir)!r} has no config.json; give the Hugging Face directory the "
                         "checkpoint was trained from")
    family = family_of(source)
    tokenizer, processor = load_processing(source, min_pixels, max_pixels)
    device = get_accelerator().device()
    if checkpoint is None:
        model = family.load_class().from_pretrained(str(load), dtype=DTYPES[dtype] if dtype else "auto",
                                                    local_files_only=True)
    else:
        model = _load_dcp(checkpoint, source, family, DTYPES[dtype or "float32"])
    model = model.to(device).eval()
    logger.info("loaded %s from %s (%s, %.2f M parameters) on %s", family.architecture, checkpoint or load,
                next(model.parameters()).dtype, sum(p.numel() for p in model.parameters()) / 1e6, device)
    return InferenceModel(family=family, model=model, tokenizer=tokenizer, processor=processor, source=source,
                          weights=checkpoint or load, device=device)


def _load_dcp(checkpoint: Path, source: Path, family: VLMFamily, dtype: torch.dtype) -> Any:
    """The model of ``source``'s config with the weights of the DCP checkpoint (strict: names and shapes must match)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    model = family.load_class()._from_config(config, dtype=torch.float32)
    state = model.state_dict()
    saved = {key[len("model."):]: meta for key, meta in
             dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items()
             if key.startswith("model.")}
    missing, unexpected = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    if missing or unexpected:
        raise ValueError(f"{checkpoint}: its model tensors do not match {source}'s {family.architecture} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}); pass the --hf-cfg-dir the run "
                         "trained from")
    for name, value in state.items():
        if tuple(saved[name].size) != tuple(value.shape):
            raise ValueError(f"{checkpoint}: {name} has shape {tuple(saved[name].size)}, {source}'s model "
                             f"{tuple(value.shape)}; pass the --hf-cfg-dir the run trained from")
    # Ties (e.g. tied embeddings) are one tensor in the state dict: DCP fills it in place.
    dcp.load({"model": state}, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state)
    return model.to(dtype)
