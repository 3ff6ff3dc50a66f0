"""The feature cache a diffusion transformer trains from: VAE latents and text embeddings, computed once.

Layout of a cache directory (MindSpeed-MM's feature-extraction flow, in safetensors)::

    index.jsonl                 one line per sample: {"id": "000042", "shard": "shard-00000.safetensors",
                                "caption": "...", "shape": [C, F, H, W]}
    shard-00000.safetensors     per sample ``ID.latents`` ([C, F, H, W] video or [C, H, W] image,
                                normalised as the model expects), ``ID.text`` ([L, D], the text
                                encoder's output for the caption's L real tokens) and, for models
                                with a pooled text input, ``ID.pooled`` ([P]); a family's conditions
                                (``ID.image_latents`` ...) and, for an editing family with text
                                dropout, ``ID.null_text`` (the empty prompt with the sample's source)
    null.safetensors            optional: ``text`` (and ``pooled``) of the empty caption, which
                                ``diffusion.text_dropout`` substitutes (zeros when absent)

:func:`write_features` writes one (``mindspeed-mm extract-features`` writes the same layout);
:class:`FeatureSet` reads it lazily, one shard open at a time.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

INDEX = "index.jsonl"
NULL = "null.safetensors"


def write_features(
    directory: str | Path,
    samples: list[dict[str, torch.Tensor]],
    captions: list[str] | None = None,
    null: dict[str, torch.Tensor] | None = None,
    shard_size: int = 256,
) -> Path:
    """Write ``samples`` (dicts of ``latents``, ``text`` and optionally ``pooled``) as a cache at ``directory``.

    The directory appears complete or not at all (written under a temporary name, then renamed).
    """
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lines = []
    for start in range(0, len(samples), shard_size):
        shard = f"shard-{start // shard_size:05d}.safetensors"
        tensors = {}
        for i in range(start, min(start + shard_size, len(samples))):
            sample_id = f"{i:06d}"
            for key, value in samples[i].items():
                tensors[f"{sample_id}.{key}"] = _own(value)
            lines.append(
                {
                    "id": sample_id,
                    "shard": shard,
                    "caption": captions[i] if captions else "",
                    "shape": list(samples[i]["latents"].shape),
                }
            )
        save_file(tensors, str(tmp / shard))
    if null is not None:
        save_file({k: _own(v) for k, v in null.items()}, str(tmp / NULL))
    (tmp / INDEX).write_text("".join(json.dumps(line) + "\n" for line in lines))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def _own(tensor: torch.Tensor) -> torch.Tensor:
    # A contiguous copy with its own storage: safetensors refuses views that share one (rows of a batch).
    return tensor.detach().cpu().clone(memory_format=torch.contiguous_format)


class FeatureSet:
    """A feature cache, read lazily.

    Raises:
        ValueError: no index, an empty index, or a line without ``id`` / ``shard`` (naming the line).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX
        if not index.is_file():
            raise ValueError(f"data.features={str(directory)!r} has no {INDEX}; give a feature cache directory")
        self.entries = []
        for number, line in enumerate(index.read_text().splitlines(), 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if "id" not in entry or "shard" not in entry:
                raise ValueError(f"{index}:{number}: a line needs `id` and `shard`; rewrite the cache")
            self.entries.append(entry)
        if not self.entries:
            raise ValueError(f"{index} lists no sample; extract features first")
        self._open: tuple[str, object] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Sample ``index``'s tensors (``latents``, ``text``, maybe ``pooled``).

        Raises:
            ValueError: the shard lacks the sample's latents or text (naming the shard and the sample).
        """
        entry = self.entries[index]
        if self._open is None or self._open[0] != entry["shard"]:
            self._open = (entry["shard"], safe_open(str(self.directory / entry["shard"]), framework="pt"))
        handle = self._open[1]
        prefix = entry["id"] + "."
        sample = {key[len(prefix) :]: handle.get_tensor(key) for key in handle.keys() if key.startswith(prefix)}
        missing = [key for key in ("latents", "text") if key not in sample]
        if missing:
            raise ValueError(
                f"{self.directory / entry['shard']}: sample {entry['id']} has no "
                f"{', '.join(entry['id'] + '.' + key for key in missing)}; re-extract its features"
            )
        return sample

    def shapes(self) -> list[tuple[int, ...]]:
        """Each sample's latent shape (from the index; read from the shard where a line has none)."""
        return [
            tuple(entry["shape"]) if "shape" in entry else tuple(self[i]["latents"].shape)
            for i, entry in enumerate(self.entries)
        ]

    def null(self) -> dict[str, torch.Tensor] | None:
        """The empty caption's ``text`` (and ``pooled``), or None when the cache has none."""
        path = self.directory / NULL
        return load_file(str(path)) if path.is_file() else None
