"""The vision-language rollout engine: the multimodal suite's generation path (transformers' ``generate``
with a KV cache, on prompts encoded as ``mindspeed-mm`` encodes them) behind the rollout interface.

A prompt is a :class:`VisionPrompt`: its token ids (a ``list``, so the trainer's pairs keep their
shape) with the encoded sample (vision inputs, ``mm_token_type_ids``) attached. ``generate`` returns
per row the new token ids (the end-of-sequence token included when it ended the reply) and their
log-probs under the engine's weights (``rollout_logp``); ``load_weights`` takes the actor's state
dict (co-located in one process: a copy of 0.2 M parameters for the demo).

The engine never samples the vision placeholder tokens (``suppress_tokens``): a reply holding one
would ask the model for image features it does not have.

Every row draws from its own random stream, seeded with its request's seed (:class:`RowSampler`), so
a reply does not depend on the rows it is batched with: data-parallel ranks that each generate a share
of a step's requests sample what one rank generating them all samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList

from mindspeed_mm.data.encode import EncodedSample
from mindspeed_mm.inference.generation import SamplingSettings, batch_inputs, eos_token_ids, generation_config
from mindspeed_mm.inference.loading import InferenceModel, load_inference_model
from mindspeed_mm.inference.prompts import Prompt, encode_prompt


class RowSampler:
    """A transformers logits processor that samples each row from its own generator (seeded per request).

    The scores are warped by transformers' own warpers (temperature, top-k, top-p, in ``generate``'s
    order), each row's token is drawn from its own ``torch.Generator``, and the returned scores are
    ``-inf`` but at the drawn token, so ``generate`` in greedy mode picks it. The rows' draws are then
    independent of the batch they are decoded in (a batched ``multinomial`` draws every row from one stream).
    """

    def __init__(self, seeds: list[int], temperature: float, top_k: int, top_p: float, device: torch.device) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers: list[Any] = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.warpers(input_ids, scores).float(), dim=-1)
        picks = torch.stack([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)])
        return torch.full_like(scores, float("-inf")).scatter_(1, picks, 0.0)


def row_seeds(params: list[Any]) -> list[int]:
    """Each row's seed (a row without one draws its seed from torch's global generator)."""
    return [int(p.seed) if p.seed is not None else int(torch.randint(0, 2**62, ())) for p in params]


class VisionPrompt(list):
    """A prompt's token ids (``list[int]``) carrying its encoded sample (``encoded``: vision inputs, types)."""

    encoded: EncodedSample

    @classmethod
    def of(cls, encoded: EncodedSample) -> VisionPrompt:
        """The prompt of an encoded sample cut where the answer starts."""
        prompt = cls(int(t) for t in encoded.input_ids)
        prompt.encoded = encoded
        return prompt


@dataclass
class VisionOutput:
    """One generated reply: ``token_ids`` and the engine's ``logprobs`` of them."""

    token_ids: list[int]
    logprobs: list[float]


def vision_token_ids(loaded: InferenceModel) -> list[int]:
    """The ids of the family's image and video tokens (never generated)."""
    family, tokenizer = loaded.family, loaded.tokenizer
    tokens = [t for t in (family.image_token, family.video_token) if t]
    return [int(tokenizer.convert_tokens_to_ids(t)) for t in tokens]


class VisionRolloutEngine:
    """``generate(prompts, params)`` / ``load_weights(state)`` over a ``mindspeed_mm`` inference model.

    Args:
        model_dir: the Hugging Face directory of the policy (its tokenizer and image processor too).
        min_pixels: images are resized to at least this many pixels. max_pixels: and to at most this many.
        max_batch_size: prompts decoded together at most.
    """

    def __init__(self, model_dir: str | Path, min_pixels: int, max_pixels: int, max_batch_size: int = 64) -> None:
        self.loaded = load_inference_model(model_dir, dtype="float32", min_pixels=min_pixels, max_pixels=max_pixels)
        self.max_batch_size = max_batch_size
        self.suppressed = vision_token_ids(self.loaded)
        self.eos = set(eos_token_ids(self.loaded))

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer."""
        return self.loaded.tokenizer

    def encode(self, prompt: Prompt) -> VisionPrompt:
        """A conversation's prompt tokens and vision inputs, as the multimodal trainer encodes them."""
        return VisionPrompt.of(encode_prompt(prompt, self.loaded))

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Take the actor's weights (its state dict, Hugging Face names)."""
        self.loaded.model.load_state_dict(state)

    def generate(self, prompts: list[VisionPrompt], params: list[Any]) -> list[VisionOutput]:
        """Replies to ``prompts`` (``params``: the rollout's sampling parameters, one per row).

        Rows are decoded ``max_batch_size`` at a time, left-padded; each row draws from its own random
        stream seeded with its own seed (:class:`RowSampler`): a reply is the same whatever rows share its batch.
        """
        outputs: list[VisionOutput] = []
        for first in range(0, len(prompts), self.max_batch_size):
            part = slice(first, first + self.max_batch_size)
            outputs += self._generate_batch(prompts[part], params[part])
        return outputs

    def _generate_batch(self, prompts: list[VisionPrompt], params: list[Any]) -> list[VisionOutput]:
        p = params[0]
        # Greedy in transformers' loop; sampling (temperature > 0) is the RowSampler's, one stream per row.
        settings = SamplingSettings(max_new_tokens=p.max_new_tokens, temperature=0.0)
        config = generation_config(self.loaded, settings)
        config.suppress_tokens = self.suppressed
        config.output_logits, config.return_dict_in_generate = True, True
        inputs = batch_inputs([prompt.encoded for prompt in prompts], self.loaded)
        processors = LogitsProcessorList(
            [RowSampler(row_seeds(params), p.temperature, p.top_k, p.top_p, inputs["input_ids"].device)]
            if p.temperature > 0
            else []
        )
        with torch.no_grad():
            out = self.loaded.model.generate(**inputs, generation_config=config, logits_processor=processors)
        start = inputs["input_ids"].shape[1]
        new = out.sequences[:, start:]
        # The raw logits (before temperature and filters): the policy's log-probs, as the actor computes them.
        logp = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        picked = logp.gather(-1, new[..., None])[..., 0]
        replies = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), len(tokens))
            replies.append(VisionOutput([int(t) for t in tokens[:end]], picked[row, :end].tolist()))
        return replies
