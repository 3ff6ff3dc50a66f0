"""``checkpoint.save_hf``: the trained model as a Hugging Face directory transformers loads as it is.

The full (unsharded) state dict is gathered to rank 0 on the CPU, written by the model's own
``save_pretrained`` (so names and layout are transformers' own), and the tokenizer, image
processor and chat template files of the source directory are copied next to it. The
directory appears complete or not at all (written under a temporary name, then renamed).
Its ``config.json`` says the dtype of the tensors written (``checkpoint.save_hf_dtype`` casts
them; auto: as trained), since transformers loads in that dtype by default.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mindspeed.checkpointing import export_guard
from mindspeed.checkpointing.hf_dtype import cast_floating, state_dtype, write_config_dtype
from mindspeed.log import get_logger

logger = get_logger(__name__)

#: Files of the source directory that the export does not copy (the export writes its own).
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
_OWN = ("config.json", "generation_config.json", "model.safetensors.index.json")
#: Folders of the source directory that the export copies (Qwen2.5-Omni's feature extractor).
_PROCESSOR_DIRS = ("audio_processor",)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole (unsharded) state dict on rank 0's host (a collective; None on the other ranks)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if dist.get_rank() == 0 else None


def save_hf(
    model: torch.nn.Module,
    source: str | Path,
    target: str | Path,
    state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write ``model`` (FSDP2-sharded or not) as a Hugging Face directory at ``target`` (a collective).

    Args:
        model: the model (its ``save_pretrained`` writes the files).
        source: the directory it came from (tokenizer, processor and template files are copied).
        target: the new directory.
        state: the full state dict to write instead of the model's own (rank 0; e.g. merged LoRA weights).
        dtype: write the floating-point tensors in this dtype (None: as they are).

    Returns:
        ``target`` on rank 0, None on the other ranks.
    """
    if state is None:
        state = full_state(model)
    target = Path(target)
    if dist.get_rank() != 0:
        dist.barrier()
        return None
    tmp = target.with_name(target.name + ".tmp")
    with export_guard(target, tmp):  # a full disk: one line, the half-written directory removed
        shutil.rmtree(tmp, ignore_errors=True)
        state = cast_floating(state, dtype)
        model.save_pretrained(tmp, state_dict=state)
        # transformers writes the model's parameter dtype, which need not be the state's.
        write_config_dtype(tmp / "config.json", state_dtype(state))
        for item in Path(source).iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHTS) and item.name not in _OWN:
                shutil.copy2(item, tmp / item.name)
            elif item.is_dir() and item.name in _PROCESSOR_DIRS:
                shutil.copytree(item, tmp / item.name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    logger.info("saved Hugging Face model to %s", target)
    dist.barrier()
    return target
