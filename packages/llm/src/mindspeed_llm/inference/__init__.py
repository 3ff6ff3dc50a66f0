"""Inference: the built-in engine behind ``mindspeed-llm generate`` and RL rollouts.

::

    from mindspeed_llm.inference import InferenceEngine, SamplingParams
    engine = InferenceEngine.from_pretrained("path/to/hf-or-megatron-checkpoint", max_batch_size=8)
    outs = engine.generate([engine.tokenizer("Hello").input_ids], SamplingParams(max_new_tokens=32))

A single-device decoder over the bridged families (:mod:`.model`), a preallocated KV cache with
continuous batching (:mod:`.cache`, :mod:`.engine`), sampling with per-request random streams
(:mod:`.sampling`), step-wise sessions that take requests while others decode (:mod:`.session`), loading through convert-ckpt's sources (:mod:`.loading`) and weight updates
from Hugging Face-named tensors through the bridges (:mod:`.weights`).
"""

from __future__ import annotations

from mindspeed_llm.inference.engine import GenerationOutput, InferenceEngine
from mindspeed_llm.inference.sampling import SamplingParams
from mindspeed_llm.inference.session import GenerationSession
from mindspeed_llm.inference.spec import SUPPORTED_FAMILIES

__all__ = ["GenerationOutput", "GenerationSession", "InferenceEngine", "SUPPORTED_FAMILIES", "SamplingParams"]
