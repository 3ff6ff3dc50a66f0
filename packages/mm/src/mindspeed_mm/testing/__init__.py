"""Fixtures for tests and examples: tiny models written in code and small mllm_format data sets."""

from mindspeed_mm.testing.fixtures import (
    write_tiny_audio_dataset,
    write_tiny_dataset,
    write_tiny_model,
    write_tiny_video_dataset,
)

__all__ = ["write_tiny_audio_dataset", "write_tiny_dataset", "write_tiny_model", "write_tiny_video_dataset"]
