"""Packing samples into one sequence with attention kept inside each sample.

The packed batch is one row: the samples' tokens one after the other (no padding), their
image patches concatenated, and ``position_ids`` of shape [4, 1, L]: row 0 the text positions
restarting at 0 in each sample (transformers builds the block-diagonal causal mask from
them: a token never attends to another sample), rows 1-3 each sample's own multimodal
rotary positions. Labels are shifted inside each sample, so the last token of a sample does
not predict the first token of the next.
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
        position_ids: [4, 1, L] (text positions, then the three rotary axes).
        pixel_values: image patches of all samples (None: no images).
        image_grid_thw: [images, 3] (None: no images).
        targets: [L] the next token inside each sample, -100 where nothing is learned.
        sample_index: [L] which sample each token belongs to (0 .. num_samples - 1).
        num_samples: samples packed.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    targets: torch.Tensor
    sample_index: torch.Tensor
    num_samples: int

    @property
    def num_label_tokens(self) -> int:
        """Tokens that are predicted."""
        return int((self.targets != IGNORE_INDEX).sum())

    def model_inputs(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments of the model's forward."""
        inputs: dict[str, Any] = {"input_ids": self.input_ids.to(device), "position_ids": self.position_ids.to(device),
                                  "use_cache": False}
        if self.pixel_values is not None:
            inputs["pixel_values"] = self.pixel_values.to(device)
            inputs["image_grid_thw"] = self.image_grid_thw.to(device)
        return inputs


def pack_samples(samples: list[EncodedSample], model: Any, family: VLMFamily) -> PackedBatch:
    """Pack ``samples`` into one row (``model`` gives the family's rotary positions of each sample)."""
    ids, positions, pixels, grids, targets, index = [], [], [], [], [], []
    for i, sample in enumerate(samples):
        length = sample.input_ids.numel()
        grid = sample.image_grid_thw
        rope = family.positions(model, sample.input_ids[None], sample.mm_token_type_ids[None], grid)
        text = torch.arange(length, dtype=rope.dtype).view(1, 1, length)
        positions.append(torch.cat([text, rope.to("cpu")], dim=0))
        ids.append(sample.input_ids)
        targets.append(torch.cat([sample.labels[1:], torch.tensor([IGNORE_INDEX])]))
        index.append(torch.full((length,), i, dtype=torch.long))
        if sample.pixel_values is not None:
            pixels.append(sample.pixel_values)
            grids.append(grid)
    return PackedBatch(
        input_ids=torch.cat(ids)[None], position_ids=torch.cat(positions, dim=2),
        pixel_values=torch.cat(pixels) if pixels else None, image_grid_thw=torch.cat(grids) if grids else None,
        targets=torch.cat(targets), sample_index=torch.cat(index), num_samples=len(samples),
    )
