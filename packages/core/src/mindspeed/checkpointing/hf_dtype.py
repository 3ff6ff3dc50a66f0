"""The dtype of a Hugging Face export: its ``config.json`` says what its tensors are.

transformers loads a model with ``dtype="auto"`` by default: it takes the dtype from
``config.json`` (``dtype``, or the legacy ``torch_dtype``) and casts the weights to it. A model
trained in float32 from a bfloat16 directory, exported with the source's config, would load in
bfloat16 and lose its small updates to rounding. Every export of the suites (``checkpoint.save_hf``,
``convert-ckpt --save-model-type hf``, ``mindspeed-mm`` and ``mindspeed-rl`` exports) therefore
writes the dtype of the tensors it wrote into ``config.json`` (:func:`write_config_dtype`), and
``checkpoint.save_hf_dtype`` (``--save-hf-dtype``) chooses it: ``auto`` keeps the dtype the model
was trained in, the others cast the floating-point tensors (:func:`cast_floating`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

#: ``checkpoint.save_hf_dtype`` values other than ``auto`` -> the dtype written.
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Every value ``checkpoint.save_hf_dtype`` accepts.
SAVE_HF_DTYPES = ("auto", *HF_DTYPES)
#: The keys transformers reads the dtype from (``dtype``, written since 4.56; ``torch_dtype`` before).
_KEYS = ("dtype", "torch_dtype")


def check_save_hf_dtype(value: str, key: str = "checkpoint.save_hf_dtype") -> None:
    """Raise ``ValueError`` naming ``key`` and the accepted values unless ``value`` is one of them."""
    if value not in SAVE_HF_DTYPES:
        raise ValueError(f"{key}={value!r} is not a dtype an export can be written in; use one of {SAVE_HF_DTYPES}")


def target_dtype(value: str) -> torch.dtype | None:
    """The dtype ``checkpoint.save_hf_dtype`` asks for (``None`` for ``auto``: as trained)."""
    check_save_hf_dtype(value)
    return HF_DTYPES.get(value)


def main_dtype(tensors: Iterable[tuple[torch.dtype, int]]) -> torch.dtype | None:
    """The floating-point dtype holding most elements among ``(dtype, numel)`` pairs (``None``: no floats)."""
    count: dict[torch.dtype, int] = {}
    for dtype, numel in tensors:
        if dtype.is_floating_point:
            count[dtype] = count.get(dtype, 0) + numel
    return max(count, key=count.__getitem__) if count else None


def state_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype | None:
    """:func:`main_dtype` of a state dict."""
    return main_dtype((t.dtype, t.numel()) for t in state.values())


def cast_floating(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors in ``dtype`` (``None``: unchanged); others as they are."""
    if dtype is None:
        return dict(state)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (as transformers writes it)."""
    return str(dtype).removeprefix("torch.")


def write_config_dtype(config_json: str | Path, dtype: torch.dtype | None) -> None:
    """Make ``config_json`` say ``dtype``: every ``dtype`` / ``torch_dtype`` key, at the top and in sub-configs.

    A config with neither key is left as it is: transformers' ``dtype="auto"`` then takes the
    dtype of the weights themselves (and a round trip stays byte-identical). So is a config that
    already says ``dtype`` everywhere. Written to a temporary name and renamed. ``dtype=None`` (no
    floating-point tensors) leaves the file as it is.
    """
    if dtype is None:
        return
    path = Path(config_json)
    config = json.loads(path.read_text(encoding="utf-8"))
    name = dtype_name(dtype)
    changed = False

    def visit(node: object) -> None:
        nonlocal changed
        if isinstance(node, dict):
            for key in _KEYS:
                if key in node and node[key] != name:
                    node[key], changed = name, True
            for value in node.values():
                visit(value)

    visit(config)
    if not changed:
        return
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    temp.replace(path)
