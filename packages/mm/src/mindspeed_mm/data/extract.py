"""``extract-features`` on every rank: the VAE and text encoder(s) run once over the media, into a feature cache.

The samples of ``data.files`` (:class:`~mindspeed_mm.data.media_features.MediaFeatures`) are cut
into shards of ``data.shard_size`` in file order; shard ``k`` is rank ``k mod world``'s. A shard is
written under a temporary name and renamed, then its index lines go to ``shard-K.json`` (the
shard's completion record). A rerun skips every shard with a record, so a killed extraction
resumes; a shard without one (a partial write) is redone and never read. When every shard is
recorded, rank 0 writes ``null.safetensors`` (the empty caption's text) and then ``index.jsonl``,
the file :class:`~mindspeed_mm.data.features.FeatureSet` needs, so a cache is readable only when
complete. Sample ids are the samples' places in the listing, so the cache does not depend on the
number of ranks.

``extract.json`` records the settings; a rerun with other settings into the same directory is
refused rather than mixed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from mindspeed.log import get_logger
from mindspeed_mm.config import MMConfig
from mindspeed_mm.data.features import INDEX, NULL
from mindspeed_mm.data.media import BadSample
from mindspeed_mm.data.media_features import MediaFeatures, encoders_dir
from mindspeed_mm.models.dit import dit_family_of

logger = get_logger(__name__)

MANIFEST = "extract.json"


@dataclass
class ExtractResult:
    """What an extraction did (rank 0's view, counts over all ranks).

    Attributes:
        directory: the cache.
        samples: samples in the index.
        shards: shards of the cache.
        written: shards written by this run (the rest were recorded by an earlier run).
        bad: samples left out by ``data.skip_bad`` (listing and decoding).
    """

    directory: str
    samples: int = 0
    shards: int = 0
    written: int = 0
    bad: int = 0


def _manifest(config: MMConfig, architecture: str) -> dict:
    d = config.data
    digests = {name: hashlib.sha256(Path(name).read_bytes()).hexdigest() for name in d.files}
    settings = {
        key: getattr(d, key)
        for key in (
            "image_dir",
            "resolutions",
            "hw_stride",
            "frame_counts",
            "fps",
            "skip_bad",
            "shard_size",
            "text_len",
            "vae_dtype",
            "text_encoder_dtype",
        )
    }
    return {
        "architecture": architecture,
        "encoders": str(encoders_dir(config).resolve()),
        "files": digests,
        "data": settings,
    }


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _own(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().clone(memory_format=torch.contiguous_format)


def _write_shard(media: MediaFeatures, directory: Path, shard: int, size: int, skip_bad: bool) -> int:
    name = f"shard-{shard:05d}.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    lines, bad = [], 0
    for i in range(shard * size, min((shard + 1) * size, len(media))):
        try:
            sample = media[i]
        except BadSample as error:
            if not skip_bad:
                raise BadSample(f"{error}; fix or remove the sample, or set data.skip_bad=true") from None
            logger.warning("skipping %s", error)
            bad += 1
            continue
        entry = media.entries[i]
        tensors.update({f"{entry['id']}.{key}": _own(value) for key, value in sample.items()})
        lines.append(
            {
                "id": entry["id"],
                "shard": name,
                "caption": entry["caption"],
                "shape": list(sample["latents"].shape),
                "source": entry["where"],
            }
        )
    tmp = directory / (name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / name)
    _write_atomic(directory / f"shard-{shard:05d}.json", json.dumps({"lines": lines, "bad": bad}))
    return bad


def extract_features(config: MMConfig, after_shard: Callable[[int], None] | None = None) -> ExtractResult:
    """Extract ``data.files``' features into ``data.features`` on the ranks of the current process group.

    Args:
        after_shard: called with each shard number this rank records (tests stop a run there).

    Raises:
        ValueError: ``data.features`` holds an extraction with other settings, or what the data raise.
    """
    d = config.data
    world, rank = dist.get_world_size(), dist.get_rank()
    family = dit_family_of(config.model.path)
    directory = Path(d.features)
    manifest = _manifest(config, family.key)
    recorded = directory / MANIFEST
    if recorded.is_file() and json.loads(recorded.read_text()) != manifest:
        raise ValueError(
            f"data.features={d.features!r} holds an extraction with other data, encoders or settings "
            f"({recorded}); remove the directory or choose another"
        )
    media = MediaFeatures(config, family)
    dist.barrier()  # every rank has compared before rank 0 writes
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(recorded, json.dumps(manifest, indent=1))
    dist.barrier()
    shards = -(-len(media) // d.shard_size)
    written, bad = 0, 0
    for shard in range(rank, shards, world):
        if (directory / f"shard-{shard:05d}.json").is_file():
            continue
        bad += _write_shard(media, directory, shard, d.shard_size, d.skip_bad)
        written += 1
        logger.info("shard %d of %d written", shard + 1, shards)
        if after_shard is not None:
            after_shard(shard)
    counts = torch.tensor([written, bad], dtype=torch.float64)
    dist.all_reduce(counts)
    result = ExtractResult(str(directory), shards=shards, written=int(counts[0]), bad=media.skipped)
    if rank == 0:
        lines = []
        for shard in range(shards):
            record = json.loads((directory / f"shard-{shard:05d}.json").read_text())
            lines += record["lines"]
            result.bad += record["bad"]
        null = {key: _own(value) for key, value in media.null().items()}
        save_file(null, str(directory / (NULL + ".tmp")))
        os.replace(directory / (NULL + ".tmp"), directory / NULL)
        _write_atomic(directory / INDEX, "".join(json.dumps(line) + "\n" for line in lines))
        for leftover in directory.glob("*.tmp"):  # writes a killed run left half done
            leftover.unlink()
        result.samples = len(lines)
        logger.info(
            "%s: %d samples in %d shards (%d written now, %d skipped as bad)",
            directory,
            result.samples,
            shards,
            result.written,
            result.bad,
        )
    dist.barrier()
    return result


def to_dict(result: ExtractResult) -> dict:
    """The result as a JSON-ready mapping."""
    return dataclasses.asdict(result)
