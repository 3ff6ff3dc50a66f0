"""Megatron LoRA weights: merged into base weights, or exported as a PEFT adapter.

MindSpeed-LLM saves LoRA fine-tuning as per-rank Megatron files holding only the adapter
tensors, named as peft names them on megatron's modules
(``decoder.layers.0.self_attention.linear_qkv.lora_A.default.weight``), with ``lora_r`` and
``lora_alpha`` in the args. Under tensor parallelism lora_A of a row-parallel layer is cut like
its input (dim 1) and lora_B of a column-parallel layer like its output (dim 0, ``[gate_r; up_r]``
for a gated ``linear_fc1``); the other factor is replicated.

Merging happens in megatron space before the bridge converts the weight, in float32, and the
result is cast back to the base weight's dtype (bf16 stays bf16). Exporting to PEFT maps lora_B
through the same rule as the weight (a fused ``linear_qkv`` B splits into q/k/v rows) and copies
lora_A to every Hugging Face projection the megatron layer fuses.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from mindspeed_llm.bridges import ModelShape, ParallelLayout, megatron_params, merge_tensors, split_tensor
from mindspeed_llm.bridges.engine import ConversionPlan, list_names
from mindspeed_llm.bridges.layout import piece_shape
from mindspeed_llm.bridges.megatron_params import MegatronParam, Split, has_extra_state
from mindspeed_llm.checkpoint.endpoints import source_pieces
from mindspeed_llm.checkpoint.megatron_legacy import LegacyCheckpointReader, LegacyCheckpointWriter, rank_dir

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.default\.weight$")


def lora_param(base: MegatronParam, which: str, rank: int) -> MegatronParam:
    """The megatron LoRA factor ``which`` ("A" or "B") of the linear weight ``base``, with its TP cut."""
    out_dim, in_dim = base.shape
    if which == "A":
        shape, split = (rank, in_dim), Split.ROW if base.split is Split.ROW else Split.REPLICATED
    else:
        shape, split = (out_dim, rank), base.split if base.split in (Split.COLUMN, Split.GLU) else Split.REPLICATED
    return MegatronParam(f"{base.module}.lora_{which}.default.weight", shape, split, base.layer, base.expert)


def _targets(shape: ModelShape) -> dict[str, MegatronParam]:
    # Linear weights of the decoder layers (not the output layer) can carry LoRA.
    return {
        p.module: p
        for p in megatron_params(shape).values()
        if p.layer is not None and p.name.endswith(".weight") and has_extra_state(p.module)
    }


class LoraCheckpoint:
    """The LoRA factors of a Megatron LoRA checkpoint, read lazily.

    Args:
        path: the checkpoint directory (per-rank files with lora_A / lora_B tensors only).
        shape: the base model.
        rank: LoRA rank (``--lora-r``) when the args do not record ``lora_r``.
        alpha: LoRA alpha (``--lora-alpha``) when the args do not record ``lora_alpha``.

    Raises:
        ValueError: missing r/alpha, tensors that are not LoRA factors of the base model's
            linear layers, a module with only one factor, or shapes that do not fit.
    """

    def __init__(self, path: Path, shape: ModelShape, rank: int | None = None, alpha: float | None = None) -> None:
        self.reader = LegacyCheckpointReader(path)
        self.layout, self.shape = self.reader.layout, shape
        args = vars(self.reader.args)
        self.rank = rank or args.get("lora_r")
        self.alpha = alpha or args.get("lora_alpha")
        if not self.rank or not self.alpha:
            raise ValueError(f"--lora-load {path} records no lora_r / lora_alpha; pass --lora-r and --lora-alpha")
        self.scaling = float(self.alpha) / float(self.rank)
        expected: dict[tuple, tuple[MegatronParam, str]] = {}
        for module, base in _targets(shape).items():
            for which in "AB":
                param = lora_param(base, which, self.rank)
                for piece in self.layout.place(param, shape):
                    expected[(piece.rank, piece.chunk, piece.name)] = (param, module)
        chunks = self.layout.num_chunks(shape)
        found: dict[str, set[str]] = {}
        unknown = []
        for key_rank in self.layout.ranks():
            for chunk, state in enumerate(self.reader.chunks(key_rank, chunks)):
                for name, value in state.items():
                    if value is None:
                        continue
                    hit = expected.get((key_rank, chunk, name))
                    if hit is None:
                        unknown.append(f"{rank_dir(key_rank, self.layout)}/{name}")
                        continue
                    param, module = hit
                    want = piece_shape(param, self.layout.tp)
                    if tuple(value.shape) != want:
                        raise ValueError(
                            f"shape mismatch: {rank_dir(key_rank, self.layout)} {name} is "
                            f"{tuple(value.shape)}, lora_r {self.rank} and the model imply {want}"
                        )
                    found.setdefault(module, set()).add(param.name)
        if unknown:
            raise ValueError(
                f"--lora-load {path} holds tensors that are not LoRA factors of the model's linear "
                f"layers: {list_names(unknown)}"
            )
        half = [m for m, names in found.items() if len(names) != 2]
        if half:
            raise ValueError(f"--lora-load {path}: only one of lora_A / lora_B for {list_names(half)}")
        if not found:
            raise ValueError(f"--lora-load {path} holds no LoRA tensors")
        self.targets = {module: _targets(shape)[module] for module in found}

    def factors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The full (unsharded) lora_A ``[r, in]`` and lora_B ``[out, r]`` of ``module``."""
        chunks = self.layout.num_chunks(self.shape)
        out = []
        for which in "AB":
            param = lora_param(self.targets[module], which, self.rank)
            pieces = source_pieces(self.layout, param, self.shape)
            out.append(
                merge_tensors(param, [self.reader.tensor(p.rank, p.chunk, p.name, chunks).load() for p in pieces])
            )
        return out[0], out[1]

    def merge(self, module: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight + alpha / r * B @ A`` in float32, returned in ``weight``'s dtype."""
        lora_a, lora_b = self.factors(module)
        return (weight.float() + self.scaling * (lora_b.float() @ lora_a.float())).to(weight.dtype)


class LoraMergedSource:
    """A source whose linear weights come out with the LoRA delta merged in.

    Args:
        base: the base model's source (:class:`HFSource` or :class:`MegatronSource`).
        lora: the LoRA checkpoint.
    """

    def __init__(self, base: Any, lora: LoraCheckpoint) -> None:
        self.base, self.lora = base, lora
        for name in ("bridge", "shape", "architecture", "assets", "kind"):
            setattr(self, name, getattr(base, name))

    def hf_shapes(self) -> Any:
        """The base source's Hugging Face shapes."""
        return self.base.hf_shapes()

    def dtypes(self, plan: ConversionPlan) -> dict[str, torch.dtype]:
        """The base source's dtypes (merging keeps them)."""
        return self.base.dtypes(plan)

    def read(self, task: Any, plan: ConversionPlan) -> torch.Tensor:
        """The base tensor, with the LoRA delta added when its module has one."""
        full = self.base.read(task, plan)
        module = task.mg_name.rsplit(".", 1)[0]
        if task.mg_name.endswith(".weight") and module in self.lora.targets:
            full = self.lora.merge(module, full)
        return full

    def describe(self) -> str:
        """One line for the report."""
        return f"{self.base.describe()} + LoRA {self.lora.reader.path} (r {self.lora.rank}, alpha {self.lora.alpha})"


def export_peft_adapter(plan: ConversionPlan, lora: LoraCheckpoint, directory: Path, base_model: str) -> list[str]:
    """Write ``lora`` as a PEFT adapter (adapter_config.json + adapter_model.safetensors).

    Args:
        plan: the base model's conversion plan (its rules map megatron modules to Hugging Face ones).
        lora: the LoRA checkpoint.
        directory: where to write.
        base_model: recorded as ``base_model_name_or_path``.

    Returns:
        The Hugging Face target module names (``q_proj`` ...).

    Raises:
        ValueError: LoRA on expert layers (PEFT's fused experts have no per-expert modules).
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    leaves = set()
    tasks = {task.mg_name: task for task in plan.tasks}
    for module, base in sorted(lora.targets.items()):
        if base.expert is not None:
            raise ValueError(
                f"LoRA on expert {module} cannot be exported to PEFT; merge it instead (omit --save-lora-to-hf)"
            )
        task = tasks[base.name]
        lora_a, lora_b = lora.factors(module)
        for hf_name, b_part in zip(task.hf_names, task.rule.to_hf(lora_b, plan.shape)):
            hf_module = hf_name.removesuffix(".weight")
            leaves.add(hf_module.rsplit(".", 1)[-1])
            tensors[f"base_model.model.{hf_module}.lora_A.weight"] = lora_a.clone()  # one copy per projection
            tensors[f"base_model.model.{hf_module}.lora_B.weight"] = b_part.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=sorted(leaves),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )
    config.save_pretrained(str(directory))
    return sorted(leaves)


def write_lora_checkpoint(
    path: Path, shape: ModelShape, layout: ParallelLayout, factors: dict[str, torch.Tensor], rank: int, alpha: float
) -> None:
    """Write full LoRA factors (``<module>.lora_A.default.weight`` ...) as a per-rank Megatron checkpoint.

    What a LoRA fine-tuning run saves; used by tests and by tools that produce adapters.
    """
    targets = _targets(shape)
    params = {}
    for name in factors:
        match = _LORA.match(name)
        if not match or match.group("module") not in targets:
            raise ValueError(f"{name} is not a LoRA factor of a linear layer of this model")
        params[name] = lora_param(targets[match.group("module")], match.group("which"), rank)
    entries: dict = {r: [] for r in layout.ranks()}
    for param in params.values():
        for piece in layout.place(param, shape):
            entries[piece.rank].append((piece.chunk, piece.name))
    args = argparse.Namespace(
        **shape.to_args(),
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        num_layers_per_virtual_pipeline_stage=layout.vpp_layers,
        lora_r=rank,
        lora_alpha=alpha,
    )
    writer = LegacyCheckpointWriter(path, layout, shape, args, entries)
    for name, param in params.items():
        pieces = split_tensor(param, factors[name], layout.tp)
        for piece in layout.place(param, shape):
            writer.write(piece.rank, piece.chunk, piece.name, pieces[piece.tp_index])
    writer.finish()
