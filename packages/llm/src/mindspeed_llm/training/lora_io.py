"""Gather the LoRA factors of a parallel run and write them: the per-rank Megatron LoRA
checkpoint that ``convert-ckpt --lora-load`` merges, or a PEFT adapter for transformers.

Every function here is collective over the default process group. Ranks of data-parallel
index 0 send their factors (each with its tensor-parallel index) to global rank 0, which glues
them with the converter's own rules (:func:`mindspeed_llm.bridges.merge_tensors`; replicated
factors must agree across ranks) and writes; a failure there is raised on every rank.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing.atomic import atomic_directory
from mindspeed.log import get_logger
from mindspeed_llm.bridges import ModelShape, ParallelLayout, merge_tensors, plan_conversion
from mindspeed_llm.checkpoint.endpoints import HFSource
from mindspeed_llm.checkpoint.lora import LoraCheckpoint, export_peft_adapter, lora_param, write_lora_checkpoint
from mindspeed_llm.training.lora import LoraSettings, lora_layers, unwrap_model
from mindspeed_llm.training.model import default_groups

logger = get_logger(__name__)


def gather_lora_factors(
    chunks: Sequence[torch.nn.Module],
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None,
    groups: Any = None,
) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) LoRA factors of the whole model, on global rank 0 (collective).

    Args:
        chunks: this rank's model chunks (wrapped or not).
        tensor_of: what to gather of each factor (default: its value; e.g. ``lambda p: p.main_grad``).
        groups: the process groups (``training.model.default_groups()``; ``None``: read them here):
            only the first data-parallel (and context-parallel) replica sends its factors.

    Returns:
        On rank 0, ``<module with global layer number>.lora_A.default.weight`` -> tensor (CPU,
        the factor's dtype); ``None`` on the other ranks.

    Raises:
        ValueError: replicated factors that differ across tensor-parallel ranks.
    """
    tensor_of = tensor_of or (lambda p: p)
    groups = groups if groups is not None else default_groups()
    local: list[tuple[Any, int, torch.Tensor]] = []
    if groups.dp_cp.rank() == 0:
        for chunk in chunks:
            for layer in lora_layers(unwrap_model(chunk)).values():
                rank = layer.lora_A["default"].weight.shape[0]
                for which, holder in (("A", layer.lora_A), ("B", layer.lora_B)):
                    value = tensor_of(holder["default"].weight)
                    if value is not None:
                        local.append(
                            (
                                lora_param(layer.lora_base, which, rank),
                                layer.tp_group.rank(),
                                value.detach().to("cpu", copy=True),
                            )
                        )
    received = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, received, dst=0)
    if dist.get_rank() != 0:
        return None
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    params = {}
    for items in received:
        for param, tp_rank, tensor in items:
            params[param.name] = param
            pieces.setdefault(param.name, {})[tp_rank] = tensor
    return {
        name: merge_tensors(params[name], [by_rank[r] for r in sorted(by_rank)]) for name, by_rank in pieces.items()
    }


def _on_rank0(work: Callable[[], None]) -> None:
    """Run ``work`` on global rank 0 and raise its error (as a ValueError) on every rank."""
    error = None
    if dist.get_rank() == 0:
        try:
            work()
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            error = f"{type(exc).__name__}: {exc}"
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ValueError(box[0])


def training_layout(chunks: Sequence[torch.nn.Module], shape: ModelShape, groups: Any = None) -> ParallelLayout:
    """The tensor/pipeline (and virtual pipeline) layout of the running job (``groups``: its
    process groups, ``training.model.default_groups()``; ``None``: read them here)."""
    groups = groups if groups is not None else default_groups()
    tp, pp = groups.tp.size(), groups.pp.size()
    vpp_layers = shape.num_layers // (pp * len(chunks)) if len(chunks) > 1 else None
    return ParallelLayout(tp=tp, pp=pp, vpp_layers=vpp_layers)


def save_lora_adapter(
    chunks: Sequence[torch.nn.Module],
    directory: str | Path,
    shape: ModelShape,
    layout: ParallelLayout | None,
    settings: LoraSettings,
    groups: Any = None,
) -> None:
    """Write the adapter as a Megatron LoRA checkpoint (per-rank files holding only the factors,
    global layer numbers, ``lora_r`` / ``lora_alpha`` in the args), atomically (collective).

    ``convert-ckpt --load-model-type mg --lora-load DIRECTORY`` merges it into a base checkpoint,
    or with ``--save-lora-to-hf`` exports it to PEFT.

    Args:
        chunks: this rank's chunks.
        directory: the output directory (replaced if it exists).
        shape: the model (:class:`ModelShape` of the base checkpoint).
        layout: the layout of the files (``None``: the training layout).
        settings: the LoRA settings (r, alpha).
        groups: the process groups (``training.model.default_groups()``; ``None``: read them here).

    Raises:
        ValueError: on every rank, if rank 0 failed (its error in the message).
    """
    layout = layout or training_layout(chunks, shape, groups)
    factors = gather_lora_factors(chunks, groups=groups)

    def write() -> None:
        layout.check(shape)
        with atomic_directory(Path(directory)) as temp:
            write_lora_checkpoint(temp, shape, layout, factors, settings.r, settings.alpha)
        logger.info(f"LoRA adapter ({len(factors)} factors, {layout.describe()}) written to {directory}")

    _on_rank0(write)


def export_peft(
    chunks: Sequence[torch.nn.Module],
    directory: str | Path,
    shape: ModelShape,
    hf_base_dir: str | Path,
    settings: LoraSettings,
    groups: Any = None,
) -> None:
    """Write the adapter as a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) for the Hugging Face model in ``hf_base_dir`` (collective).

    ``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_base_dir), directory)``
    then computes what the megatron model computes. A fused ``linear_qkv`` / ``linear_fc1`` B is
    split into q/k/v (gate/up) rows and A copied to each projection.

    Args:
        chunks: this rank's chunks.
        directory: the output directory (replaced if it exists).
        shape: the model.
        hf_base_dir: the base Hugging Face checkpoint (recorded as ``base_model_name_or_path``).
        settings: the LoRA settings.
        groups: the process groups (``training.model.default_groups()``; ``None``: read them here).

    Raises:
        ValueError: on every rank: a base checkpoint of another model, or any failure of rank 0.
    """
    factors = gather_lora_factors(chunks, groups=groups)

    def write() -> None:
        source = HFSource(Path(hf_base_dir))
        if dataclasses.replace(shape, params_dtype=source.shape.params_dtype) != source.shape:
            raise ValueError(
                f"hf_base_dir {hf_base_dir} holds another model than the one trained; pass the base "
                "checkpoint the run started from"
            )
        plan = plan_conversion(source.bridge, source.shape, source.hf_shapes())
        with tempfile.TemporaryDirectory(prefix="lora-") as staging:
            write_lora_checkpoint(Path(staging), shape, ParallelLayout(), factors, settings.r, settings.alpha)
            lora = LoraCheckpoint(Path(staging), shape)
            with atomic_directory(Path(directory)) as temp:
                modules = export_peft_adapter(plan, lora, temp, str(hf_base_dir))
        logger.info(f"PEFT adapter (target modules {', '.join(modules)}) written to {directory}")

    _on_rank0(write)
