"""Packing samples into one sequence with attention kept inside each sample.

The packed batch is one row: the samples' tokens one after the other (no padding), their
vision inputs concatenated, and ``position_ids`` whose first row is the text position
restarting at 0 in each sample (transformers builds the block-diagonal causal mask from it:
a token never attends to another sample); M-RoPE families add each sample's own three rotary
axes below it (``[4, 1, L]``), 1-D families have that row only (``[1, L]``). Labels are
shifted inside each sample, so the last token of a sample does not predict the first token
of the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_mm.data.encode import IGNORE_INDEX, EncodedSample
from mindspeed_mm.models.family import VLMFamily


@dataclass
class PackedBatch:
    """One microbatch.

    Attributes:
        input_ids: [1, L].
        position_ids: [4, 1, L] (text positions, then the three rotary axes) or [1, L].
        vision: the samples' vision inputs concatenated (empty: no images).
        targets: [L] the next token inside each sample, -100 where nothing is learned.
        sample_index: [L] which sample each token belongs to (0 .. num_samples - 1).
        num_samples: samples packed.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    vision: dict[str, torch.Tensor]
    targets: torch.Tensor
    sample_index: torch.Tensor
    num_samples: int

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """The image input (None: no images)."""
        return self.vision.get("pixel_values")

    @property
    def num_label_tokens(self) -> int:
        """Tokens that are predicted."""
        return int((self.targets != IGNORE_INDEX).sum())

    def model_inputs(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments of the model's forward."""
        inputs: dict[str, Any] = {
            "input_ids": self.input_ids.to(device),
            "position_ids": self.position_ids.to(device),
            "use_cache": False,
        }
        inputs.update({key: value.to(device) for key, value in self.vision.items()})
        return inputs


def pack_samples(samples: list[EncodedSample], model: Any, family: VLMFamily) -> PackedBatch:
    """Pack ``samples`` into one row (``model`` gives the family's positions of each sample)."""
    ids, positions, targets, index = [], [], [], []
    vision: dict[str, list[torch.Tensor]] = {}
    for i, sample in enumerate(samples):
        length = sample.input_ids.numel()
        positions.append(family.positions(model, sample))
        ids.append(sample.input_ids)
        targets.append(torch.cat([sample.labels[1:], torch.tensor([IGNORE_INDEX])]))
        index.append(torch.full((length,), i, dtype=torch.long))
        for key, value in sample.vision.items():
            vision.setdefault(key, []).append(value)
    return PackedBatch(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(positions, dim=-1),
        vision={key: torch.cat(values) for key, values in vision.items()},
        targets=torch.cat(targets),
        sample_index=torch.cat(index),
        num_samples=len(samples),
    )
