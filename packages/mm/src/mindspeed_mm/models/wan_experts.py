"""Wan2.2's two-expert mixture: a high-noise and a low-noise transformer switched at a boundary timestep.

diffusers' ``WanPipeline(transformer=..., transformer_2=..., boundary_ratio=...)`` runs
``transformer`` on the timesteps ``t >= boundary_ratio x num_train_timesteps`` and ``transformer_2``
below; the pipeline directory holds them as ``transformer/`` and ``transformer_2/`` and records
``boundary_ratio`` in ``model_index.json``. Training (``diffusion.expert``) takes one expert alone
(its range of the timestep grid, :meth:`~mindspeed_mm.diffusion.FlowMatching.expert_range`) or both
in one run (:class:`ExpertPair`: each sample goes to the expert of its timestep).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models.dit import DiTFamily, build_meta_dit, load_dit

#: The pipeline's folders of the two experts, high noise first.
EXPERT_FOLDERS = ("transformer", "transformer_2")


def pipeline_boundary_ratio(model_path: str | Path) -> float | None:
    """``boundary_ratio`` of the pipeline whose transformer folder is ``model_path`` (its parent's model_index.json)."""
    index = Path(model_path).parent / "model_index.json"
    if not index.is_file():
        return None
    return json.loads(index.read_text()).get("boundary_ratio")


def resolve_boundary_ratio(configured: float | None, model_path: str | Path, expert: str) -> float:
    """The recipe's ``diffusion.boundary_ratio``, else the pipeline's.

    Raises:
        ValueError: neither gives one.
    """
    ratio = configured if configured is not None else pipeline_boundary_ratio(model_path)
    if ratio is None:
        raise ValueError(
            f"diffusion.expert={expert}: no boundary_ratio in the recipe nor in {Path(model_path).parent}/"
            "model_index.json; set diffusion.boundary_ratio (Wan2.2 T2V: 0.875)"
        )
    return float(ratio)


def second_expert_path(model_path: str | Path) -> Path:
    """The low-noise expert beside ``model_path`` (the pipeline's ``transformer_2``).

    Raises:
        ValueError: it is not there.
    """
    path = Path(model_path).parent / EXPERT_FOLDERS[1]
    if not (path / "config.json").is_file():
        raise ValueError(
            f"diffusion.expert=both: {path} has no config.json; give model.path as the transformer folder of a "
            "Wan2.2 pipeline (transformer/ and transformer_2/ side by side)"
        )
    return path


class ExpertPair(torch.nn.Module):
    """Both experts as one module: each sample of a batch goes to the expert of its timestep.

    ``forward`` takes the transformer's arguments; samples with ``timestep >= boundary`` run through
    ``transformer`` (high noise), the others through ``transformer_2``, and the predictions are put
    back in the batch's order. An expert with no sample runs on the batch's first sample with its
    output multiplied by zero, so that every rank runs both experts' forward and backward (FSDP2's
    collectives stay matched whatever each rank drew).
    """

    def __init__(self, transformer: Any, transformer_2: Any, boundary: float) -> None:
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary = boundary

    @property
    def config(self) -> Any:
        """The high-noise expert's configuration (the experts share their shapes)."""
        return self.transformer.config

    @property
    def experts(self) -> tuple[Any, Any]:
        """``(transformer, transformer_2)``: LoRA and sequence parallelism go into each as into one model."""
        return self.transformer, self.transformer_2

    @property
    def _repeated_blocks(self) -> list[str]:
        """The experts' repeated block classes (``train.compile`` compiles the blocks of both)."""
        return list(getattr(self.transformer, "_repeated_blocks", None) or ())

    def forward(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor]:
        kwargs["return_dict"] = False
        high = timestep >= self.boundary
        out: torch.Tensor | None = None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            index = rows.nonzero().flatten()
            empty = index.numel() == 0
            if empty:
                index = torch.zeros(1, dtype=torch.long, device=timestep.device)
            rows_kwargs = {  # per-sample inputs (Wan I2V's image features) follow their samples
                k: v[index] if isinstance(v, torch.Tensor) and v.shape[:1] == hidden_states.shape[:1] else v
                for k, v in kwargs.items()
            }
            pred = expert(
                hidden_states=hidden_states[index],
                timestep=timestep[index],
                encoder_hidden_states=encoder_hidden_states[index],
                **rows_kwargs,
            )[0]
            if out is None:
                out = pred.new_zeros((hidden_states.shape[0], *pred.shape[1:]))
            out = out + 0 * pred.sum() if empty else out.index_copy(0, index, pred)
        return (out,)


def load_pair(model_path: str | Path, family: DiTFamily, boundary: float, meta: bool = False) -> ExpertPair:
    """Both experts of the pipeline whose ``transformer`` folder is ``model_path`` (on the meta device with ``meta``)."""
    build = build_meta_dit if meta else load_dit
    return ExpertPair(build(model_path, family), build(second_expert_path(model_path), family), boundary)


def pair_plan(plan: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """A family's FSDP2 plan applied to both experts of an :class:`ExpertPair`."""
    return tuple(f"{folder}.{pattern}" for folder in EXPERT_FOLDERS for pattern in plan)
