"""Writing the trained policy as a Hugging Face directory (``checkpoint.save_hf``).

The source's ``config.json`` travels with the weights, its dtype rewritten to the tensors' own
(transformers loads in that dtype by default); ``checkpoint.save_hf_dtype`` casts them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from mindspeed.checkpointing import export_guard
from mindspeed.checkpointing.hf_dtype import cast_floating, state_dtype, write_config_dtype

#: Files of the starting model directory that travel with the weights (config, tokenizer, template).
_CARRIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
)


def write_hf_dir(
    state: Mapping[str, torch.Tensor], source: str | Path, target: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write ``state`` (Hugging Face names) as ``target/model.safetensors`` next to ``source``'s config and tokenizer.

    The floating-point tensors are written in ``dtype`` (``None``: as they are) and the config
    says the dtype written.

    The directory is written under a temporary name and renamed into place, so a crash never
    leaves a half-written model where ``target`` was; an existing ``target`` is replaced.

    Returns:
        The target directory.
    """
    from safetensors.torch import save_file

    source, target = Path(source), Path(target)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with export_guard(target, staging):  # a full disk: one line, the half-written directory removed
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in _CARRIED:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
        # Tied weights share storage: safetensors refuses aliases, so every tensor is its own copy.
        tensors = cast_floating({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, dtype)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if (staging / "config.json").is_file():
            write_config_dtype(staging / "config.json", state_dtype(tensors))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target
