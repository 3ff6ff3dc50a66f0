"""Inference for ``mindspeed-mm generate`` and ``evaluate``: loading (Hugging Face directory or DCP checkpoint),
prompt encoding (the trainer's), and generation with the transformers model's own ``generate``; for diffusion
transformers, loading a pipeline with its transformer's weights (:mod:`~mindspeed_mm.inference.dit_pipeline`)."""

from mindspeed_mm.inference.generation import SamplingSettings, TextStreamer, generate_tokens, model_inputs
from mindspeed_mm.inference.loading import InferenceModel, load_inference_model
from mindspeed_mm.inference.prompts import Prompt, encode_prompt, encode_with_answer, prompt_from_text, read_prompt_file

__all__ = [
    "InferenceModel",
    "Prompt",
    "SamplingSettings",
    "TextStreamer",
    "encode_prompt",
    "encode_with_answer",
    "generate_tokens",
    "load_inference_model",
    "model_inputs",
    "prompt_from_text",
    "read_prompt_file",
]
