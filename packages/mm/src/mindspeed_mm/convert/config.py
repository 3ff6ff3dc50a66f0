"""The options of ``mindspeed-mm convert`` (no torch import: the CLI builds its flags from them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FORMATS = ("dcp", "hf", "peft", "lora")
#: (load format, save format) -> what it does.
CONVERSIONS = {
    ("dcp", "hf"): "model (LoRA merged)",
    ("hf", "dcp"): "model",
    ("dcp", "peft"): "LoRA adapter",
    ("peft", "dcp"): "base + adapter",
    ("peft", "hf"): "merge",
    ("dcp", "lora"): "diffusers LoRA",
    ("lora", "dcp"): "base + diffusers LoRA",
    ("lora", "hf"): "merge a diffusers LoRA",
}
NEEDS_BASE = {("dcp", "hf"), ("peft", "dcp"), ("peft", "hf"), ("lora", "dcp"), ("lora", "hf")}
#: Formats of a LoRA adapter: PEFT's directory, diffusers' ``pytorch_lora_weights.safetensors``.
ADAPTER_FORMATS = ("peft", "lora")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(kw_only=True)
class ConvertConfig:
    """Every ``mindspeed-mm convert`` option (the CLI flags are these names with dashes).

    Attributes:
        load_format: ``dcp`` (a training checkpoint: SAVE/step_XXXXXXXX, or SAVE for its newest),
            ``hf`` (a Hugging Face model directory, or a diffusers transformer directory), ``peft``
            (a PEFT LoRA adapter directory) or ``lora`` (a diffusers LoRA directory:
            pytorch_lora_weights.safetensors, what a diffusers pipeline's load_lora_weights reads).
        save_format: ``hf``, ``dcp``, ``peft`` or ``lora``.
        load_dir: the source directory.
        save_dir: the output directory (created; must be empty unless ``overwrite``).
        base_dir: the base Hugging Face model directory: its config names the tensors, its
            tokenizer, image processor and chat template go into a Hugging Face output, and its
            weights are the base under a PEFT adapter (needed for dcp -> hf, peft -> dcp, peft -> hf).
        lora_alpha: LoRA alpha of a DCP checkpoint with LoRA factors (the recipe's lora.alpha);
            default: what the run recorded in adapter_config.json next to its checkpoints.
        dtype: store floating-point tensors in this type (``bfloat16``, ``float16``, ``float32``;
            default: as the source stores them; LoRA merges are computed in fp32 first).
        max_shard_size: safetensors shard size of a Hugging Face output ("5GB", "500MB", bytes).
        overwrite: replace a non-empty ``save_dir``.
        progress: draw a progress bar.
        ema: a checkpoint of a ``train.ema`` run gives the moving averages of its weights (the
            default); ``--no-ema``: its raw trained weights.
    """

    load_format: str
    save_format: str
    load_dir: Path
    save_dir: Path
    base_dir: Path | None = None
    lora_alpha: float | None = None
    dtype: str | None = None
    max_shard_size: str = "5GB"
    overwrite: bool = False
    progress: bool = True
    ema: bool = True
