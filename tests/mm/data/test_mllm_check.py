"""Vision-language samples with unreadable media: found when the task is built; one line, or skipped and counted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mindspeed_mm.data.media import BadSample
from mindspeed_mm.data.mllm import read_mllm_files
from mindspeed_mm.data.mllm_check import check_mllm_media
from mindspeed_mm.testing import write_tiny_dataset


def test_unreadable_images_are_one_line_or_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = write_tiny_dataset(tmp_path / "d", num_samples=8)
    images = sorted((tmp_path / "d" / "images").iterdir())
    images[0].write_bytes(b"not an image at all")  # sample 1 (line 1)
    png = images[1].read_bytes()
    images[1].write_bytes(png[: len(png) // 2])  # sample 2: truncated after its header
    samples = read_mllm_files([str(data)])
    with pytest.raises(BadSample) as info:
        check_mllm_media(samples, skip_bad=False)
    line = str(info.value)
    assert "\n" not in line and f"{data}:1: image {images[0]} cannot be read" in line, line
    assert line.endswith("fix or remove the sample, or set data.skip_bad=true"), line
    with caplog.at_level(logging.WARNING):
        kept, bad = check_mllm_media(samples, skip_bad=True)
    assert bad == 2 and [s.source for s in kept] == [s.source for s in samples[2:]]
    messages = [r.getMessage() for r in caplog.records]
    assert f"data.skip_bad: 2 of {len(samples)} samples of data.files skipped" in messages, messages
    for image in images[2:]:
        image.write_bytes(b"")
    with pytest.raises(ValueError, match="no sample has readable media"):
        check_mllm_media([s for s in read_mllm_files([str(data)]) if s.images], skip_bad=True)
