"""Encoding every sample up front: in parallel processes, and cached on disk.

``data.workers = N`` encodes the samples (chat template, tokenizer, image and video processors)
in ``N`` processes (1: in this one); the result is in sample order and the same whatever ``N``.
``data.cache_dir`` keeps the encoded samples in a folder named by a key, a hash of everything the
encoding depends on:

- the data files' contents, and each image and video's path, size and modification time;
- the model directory's tokenizer, chat template, processor and config files (contents);
- the settings (``cutoff_len``, ``train_on_prompt``, ``mask_history``, the image and video pixel
  bounds, ``video_fps``, ``video_maxlen``, ``image_dir``, ``max_samples``) and the versions of
  this package and transformers.

A run whose key is in the cache reads the samples from it instead of encoding them; any change
gives a new key, so a stale entry is never read. An entry is written under a temporary name and
renamed into place when complete, so a killed run leaves no half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed_mm.data.encode import EncodedSample, encode_sample
from mindspeed_mm.data.mllm import MllmSample
from mindspeed_mm.data.video import VideoSettings
from mindspeed_mm.models.family import VLMFamily

logger = get_logger(__name__)

#: Files of a model directory that the encoding reads (their contents go into the cache key).
PROCESSING_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "vocab.json",
    "merges.txt",
    "audio_processor/preprocessor_config.json",
)
#: Bumped when the stored layout or the encoding itself changes.
CACHE_FORMAT = 2  # 2: InternVL images cut into tiles as InternVLProcessor cuts them


@dataclass(frozen=True)
class EncodeSettings:
    """What :func:`~mindspeed_mm.data.encode.encode_sample` is given besides the sample and the processors."""

    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False
    video: VideoSettings = VideoSettings()


@dataclass
class Processing:
    """The tokenizer, processors and family that encode samples (one set per process)."""

    tokenizer: Any
    image_processor: Any
    family: VLMFamily
    video_processor: Any = None
    audio_processor: Any = None

    def encode(self, sample: MllmSample, settings: EncodeSettings) -> EncodedSample:
        """``sample`` encoded with these processors."""
        return encode_sample(
            sample,
            self.tokenizer,
            self.image_processor,
            self.family,
            settings.cutoff_len,
            settings.train_on_prompt,
            settings.mask_history,
            video_processor=self.video_processor,
            video_settings=settings.video,
            audio_processor=self.audio_processor,
        )


def cache_key(
    files: list[str], samples: list[MllmSample], model_dir: str | Path, settings: EncodeSettings, extra: dict
) -> str:
    """The hash that names a cache entry (see the module docstring)."""
    import transformers

    from mindspeed_mm import __version__

    digest = hashlib.sha256()

    def add(item: Any) -> None:
        digest.update(json.dumps(item, sort_keys=True, default=str).encode())

    add({"format": CACHE_FORMAT, "mindspeed_mm": __version__, "transformers": transformers.__version__})
    add({"settings": asdict(settings), **extra})
    for name in files:
        digest.update(Path(name).resolve().as_posix().encode())
        digest.update(hashlib.sha256(Path(name).read_bytes()).digest())
    for name in PROCESSING_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    for sample in samples:
        media = list(sample.images) + list(sample.audios)
        for video in sample.videos:
            media += list(video) if isinstance(video, tuple) else _video_files(video)
        for path in media:
            stat = os.stat(path)
            add([path, stat.st_size, stat.st_mtime_ns])
    return digest.hexdigest()[:24]


def _video_files(video: str) -> list[str]:
    path = Path(video)
    return sorted(str(p) for p in path.iterdir()) if path.is_dir() else [video]


def read_cache(directory: Path) -> list[EncodedSample] | None:
    """The samples of a complete cache entry, or None when there is none."""
    target = directory / "samples.pt"
    if not target.is_file():
        return None
    stored = torch.load(target, weights_only=True)
    return [EncodedSample(**record) for record in stored]


def write_cache(directory: Path, encoded: list[EncodedSample], about: dict) -> None:
    """Write an entry atomically: a temporary folder beside it, renamed into place when complete."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        torch.save(_records(encoded), staging / "samples.pt")
        (staging / "about.json").write_text(json.dumps(about, indent=1, default=str) + "\n")
        os.replace(staging, directory)
    except OSError:
        if directory.is_dir():  # another process wrote the same entry first: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
            return
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _records(encoded: list[EncodedSample]) -> list[dict[str, Any]]:
    return [
        {
            "input_ids": s.input_ids,
            "labels": s.labels,
            "mm_token_type_ids": s.mm_token_type_ids,
            "vision": s.vision,
            "source": s.source,
        }
        for s in encoded
    ]


def encode_samples(
    samples: list[MllmSample], processing: Processing, settings: EncodeSettings, workers: int
) -> list[EncodedSample]:
    """Every sample encoded, in order, by ``workers`` processes (1: this one).

    The workers are forked children (they inherit the processors; a training rank, even a daemonic
    one, may fork), worker ``w`` encoding samples ``w, w + N, ...`` into a file the parent reads back.
    A sample that fails raises here the error of the first failing sample in file order.
    """
    workers = min(workers, len(samples))
    if workers <= 1:
        return [processing.encode(sample, settings) for sample in samples]
    staging = Path(tempfile.mkdtemp(prefix="mindspeed-mm-encode-"))
    try:
        pids = [_fork_worker(w, workers, samples, processing, settings, staging) for w in range(workers)]
        failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
        encoded: dict[int, EncodedSample] = {}
        errors: list[tuple[int, str, str]] = []
        for w in range(workers):
            path = staging / f"{w}.pt"
            if not path.is_file():
                continue
            part = torch.load(path, weights_only=True)
            encoded.update({i: EncodedSample(**r) for i, r in zip(part["indices"], part["records"])})
            if part["error"]:
                errors.append(tuple(part["error"]))
        if errors:
            index, kind, message = min(errors)
            raise ValueError(message) if kind == "ValueError" else RuntimeError(f"{kind}: {message}")
        if failed or len(encoded) != len(samples):
            raise RuntimeError(f"{len(failed)} data.workers process(es) died; run with data.workers=1 to see why")
        return [encoded[i] for i in range(len(samples))]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fork_worker(
    worker: int, workers: int, samples: list[MllmSample], processing: Processing, settings: EncodeSettings, out: Path
) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:  # the child: encode its share, write it, and leave without running the parent's exit handlers
        torch.set_num_threads(1)  # N processes share the cores: one intra-op thread each
        indices, encoded, error = [], [], None
        for index in range(worker, len(samples), workers):
            try:
                encoded.append(processing.encode(samples[index], settings))
            except Exception as err:  # noqa: BLE001  (reported to the parent, which raises it)
                error = (index, "ValueError" if isinstance(err, ValueError) else type(err).__name__, str(err))
                break
            indices.append(index)
        torch.save({"indices": indices, "records": _records(encoded), "error": error}, out / f"{worker}.pt")
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)


def preprocess(
    samples: list[MllmSample],
    processing: Processing,
    settings: EncodeSettings,
    workers: int,
    cache_dir: str | None,
    files: list[str],
    model_dir: str | Path,
    extra: dict | None = None,
) -> tuple[list[EncodedSample], dict[str, Any]]:
    """The encoded samples (from the cache when its key is there) and what happened
    (``{"cache": "hit" | "miss" | "off", "seconds": ..., "key": ...}``)."""
    start = time.perf_counter()
    entry = None
    if cache_dir:
        key = cache_key(files, samples, model_dir, settings, extra or {})
        entry = Path(cache_dir) / key
        cached = read_cache(entry)
        if cached is not None:
            seconds = time.perf_counter() - start
            logger.info("data cache hit: %d encoded samples read from %s in %.2f s", len(cached), entry, seconds)
            return cached, {"cache": "hit", "seconds": seconds, "key": key}
    encoded = encode_samples(samples, processing, settings, workers)
    if entry is not None:
        write_cache(entry, encoded, {"files": files, "model": str(model_dir), "samples": len(encoded)})
    seconds = time.perf_counter() - start
    logger.info(
        "encoded %d samples in %.2f s with %d worker(s)%s",
        len(encoded),
        seconds,
        max(1, workers),
        f"; cached in {entry}" if entry is not None else "",
    )
    return encoded, {"cache": "miss" if entry is not None else "off", "seconds": seconds, "key": entry and entry.name}
