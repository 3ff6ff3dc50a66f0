"""Preprocessing of video samples for ``mindspeed-mm train``: 1 vs N workers, and a cache miss vs a hit.

Writes ``--samples`` mllm_format samples, each with its own .mp4 (``--frames`` frames of 128 x 96 at
8 fps, PyAV) or, every fourth, an image and an .mp4, and a tiny model of ``--family``; then times
:func:`mindspeed_mm.data.preprocess.preprocess` (decode at 2 fps up to 16 frames, the family's
video processor, the chat template, tokenizing) with 1 worker, with ``--workers`` workers, writing
the cache, and reading it back (wall and CPU seconds, this process and its workers), and checks
that every run gives the same samples. Usage::

    uv run --frozen python tools/bench/vlm_preprocess.py --samples 96 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_data(root: Path, samples: int, frames: int) -> Path:
    """``root/data.jsonl`` and its media."""
    from PIL import Image

    from mindspeed_mm.testing.fixtures import moving_bar, write_mp4

    rng = np.random.default_rng(0)
    lines = []
    Image.fromarray(np.full((96, 128, 3), 200, dtype=np.uint8)).save(root / "grey.png")
    for i in range(samples):
        colour = tuple(int(c) for c in rng.integers(0, 255, 3))
        write_mp4(root / f"v{i:04d}.mp4", moving_bar(frames, 96, 128, colour), 8)
        record = {
            "messages": [
                {"role": "user", "content": "<video>What colour moves?"},
                {"role": "assistant", "content": f"rgb{colour}"},
            ],
            "videos": [f"v{i:04d}.mp4"],
        }
        if i % 4 == 3:
            record["messages"][0]["content"] = "<image>" + record["messages"][0]["content"]
            record["images"] = ["grey.png"]
        lines.append(json.dumps(record))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root / "data.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--family", default="Qwen2_5_VLForConditionalGeneration")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of this process (workers: 1)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)  # as each worker: the comparison is of processes, not of thread pools

    from mindspeed_mm.data import read_mllm_files
    from mindspeed_mm.data.preprocess import EncodeSettings, Processing, preprocess
    from mindspeed_mm.data.video import VideoSettings
    from mindspeed_mm.models import family_of, load_processing, load_video_processor
    from mindspeed_mm.testing import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_model(root / "model", args.family)
        data = write_data(root, args.samples, args.frames)
        samples = read_mllm_files([str(data)])
        tokenizer, processor = load_processing(model, 784, 12544)
        processing = Processing(tokenizer, processor, family_of(model), load_video_processor(model))
        settings = EncodeSettings(cutoff_len=8192, video=VideoSettings(fps=2, maxlen=16, max_pixels=12288))

        cpu: dict[str, float] = {}

        def run(name: str, workers: int, cache: str | None) -> tuple[list, float, str]:
            start, before = time.perf_counter(), os.times()
            encoded, about = preprocess(samples, processing, settings, workers, cache, [str(data)], model)
            after = os.times()
            cpu[name] = round(sum(after[i] - before[i] for i in range(4)), 2)  # this process and its workers
            return encoded, time.perf_counter() - start, about["cache"]

        one, one_s, _ = run("workers_1", 1, None)
        many, many_s, _ = run(f"workers_{args.workers}", args.workers, None)
        written, miss_s, miss = run("cache_miss_write", args.workers, str(root / "cache"))
        read, hit_s, hit = run("cache_hit_read", 1, str(root / "cache"))
        same = all(
            a.input_ids.equal(b.input_ids) and all(v.equal(b.vision[k]) for k, v in a.vision.items())
            for other in (many, written, read)
            for a, b in zip(one, other, strict=True)
        )
        result = {
            "samples": len(samples),
            "video_tokens": int(sum((s.mm_token_type_ids == 2).sum() for s in one)),
            "workers_1_s": round(one_s, 2),
            f"workers_{args.workers}_s": round(many_s, 2),
            "cache_miss_write_s": round(miss_s, 2),
            "cache_hit_read_s": round(hit_s, 3),
            "cpu_s": cpu,
            "load_average": [round(x, 1) for x in os.getloadavg()],
            "cache": [miss, hit],
            "identical": same,
        }
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0 if same and hit == "hit" else 1


if __name__ == "__main__":
    sys.exit(main())
