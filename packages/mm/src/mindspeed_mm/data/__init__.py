"""Vision-language data: mllm_format records, their encoding with the model's processor, packing."""

from mindspeed_mm.data.encode import EncodedSample, encode_sample
from mindspeed_mm.data.mllm import MllmSample, read_mllm_files
from mindspeed_mm.data.packing import PackedBatch, pack_samples

__all__ = ["EncodedSample", "MllmSample", "PackedBatch", "encode_sample", "pack_samples", "read_mllm_files"]
