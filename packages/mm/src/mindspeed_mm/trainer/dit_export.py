"""``checkpoint.save_hf`` for a diffusion transformer: a diffusers directory that ``from_pretrained`` loads as it is.

The full state dict is gathered to rank 0 on the host (with LoRA: the base weights with the
factors merged in), assigned to a model of the source's
configuration built on the meta device (no second copy), and written by diffusers' own
``save_pretrained`` (``config.json`` plus ``diffusion_pytorch_model.safetensors``, sharded as
diffusers shards). Other non-weight files of the source are copied. The directory appears
complete or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from mindspeed.checkpointing import export_guard
from mindspeed.checkpointing.hf_dtype import cast_floating
from mindspeed.log import get_logger
from mindspeed_mm.config import MMLoraConfig
from mindspeed_mm.models.diffusers_lora import write_diffusers_lora
from mindspeed_mm.models.dit import DiTFamily, build_meta_dit
from mindspeed_mm.models.lora import AdapterSettings, adapted_modules, factor_names
from mindspeed_mm.models.peft_io import Adapter
from mindspeed_mm.models.wan_experts import EXPERT_FOLDERS, second_expert_path
from mindspeed_mm.trainer.export import full_state

logger = get_logger(__name__)

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
_OWN = ("config.json", "diffusion_pytorch_model.safetensors.index.json")


def write_dit_lora(state: dict[str, torch.Tensor], lora: MMLoraConfig, family: DiTFamily, target: str | Path) -> Path:
    """Write the LoRA factors of a trained transformer's full state dict as a diffusers LoRA directory, atomically.

    ``target/pytorch_lora_weights.safetensors`` is what ``pipe.load_lora_weights(target)`` reads
    (:mod:`mindspeed_mm.models.diffusers_lora`); its metadata records ``lora.r``, ``lora.alpha``
    and the adapted modules' names.
    """
    pairs = {}
    for module in adapted_modules(state):
        a, b = (state[name] for name in factor_names(module))
        pairs[module] = (a, b)
    settings = AdapterSettings(lora.r, lora.alpha, sorted(pairs), lora.dropout)
    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_diffusers_lora(Adapter(settings, pairs), tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    logger.info("saved the diffusers LoRA (%d linears of %s) to %s", len(pairs), family.architecture, target)
    return target


def save_diffusers(
    model: torch.nn.Module,
    family: DiTFamily,
    source: str | Path,
    target: str | Path,
    state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write the (FSDP2-sharded) ``model`` as a diffusers directory at ``target`` (a collective).

    Args:
        state: the full state dict to write instead of the model's own (rank 0; e.g. merged LoRA weights;
            other ranks pass anything, and every rank then skips the gather).
        dtype: write the floating-point tensors in this dtype (None: as trained). diffusers'
            config has no dtype key: its ``from_pretrained`` loads float32 unless told otherwise.

    Returns:
        ``target`` on rank 0, None on the other ranks.
    """
    if state is None:
        state = full_state(model)
    target = Path(target)
    if dist.get_rank() != 0:
        dist.barrier()
        return None
    plain = build_meta_dit(source, family)
    plain.load_state_dict(cast_floating(state, dtype), strict=True, assign=True)
    tmp = target.with_name(target.name + ".tmp")
    with export_guard(target, tmp):  # a full disk: one line, the half-written directory removed
        shutil.rmtree(tmp, ignore_errors=True)
        plain.save_pretrained(str(tmp))
        for item in Path(source).iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHTS) and item.name not in _OWN:
                shutil.copy2(item, tmp / item.name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    logger.info("saved diffusers model to %s", target)
    dist.barrier()
    return target


def save_expert_pair(
    model: torch.nn.Module,
    family: DiTFamily,
    source: str | Path,
    target: str | Path,
    boundary_ratio: float,
    state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write a trained :class:`~mindspeed_mm.models.wan_experts.ExpertPair` as a Wan2.2 pipeline's experts (a collective).

    ``target/transformer`` and ``target/transformer_2`` are :func:`save_diffusers` directories (each
    with its source folder's other files), and ``target/model_index.json`` is the source pipeline's
    (else a ``WanPipeline`` index naming the two transformers) with ``boundary_ratio``: copy the
    pipeline's other folders (VAE, text encoder, tokenizer, scheduler) beside them to load the whole
    pipeline.

    Returns:
        ``target`` on rank 0, None on the other ranks.
    """
    if state is None:
        state = full_state(model)
    target = Path(target)
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    sources = (Path(source), second_expert_path(source))
    for folder, folder_source in zip(EXPERT_FOLDERS, sources):
        prefix = folder + "."
        part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        save_diffusers(model, family, folder_source, target / folder, state=part, dtype=dtype)
    if dist.get_rank() != 0:
        return None
    index_file = Path(source).parent / "model_index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
    else:
        import diffusers

        index = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__}
        index.update({folder: ["diffusers", family.architecture] for folder in EXPERT_FOLDERS})
    index["boundary_ratio"] = boundary_ratio
    (target / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    logger.info("saved the Wan2.2 experts (boundary_ratio %s) to %s", boundary_ratio, target)
    return target
