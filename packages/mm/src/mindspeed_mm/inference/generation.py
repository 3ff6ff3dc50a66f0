"""Generation with the transformers model's own ``generate`` on prompts encoded by the trainer's encoding.

Sampling settings are given explicitly (a fresh ``GenerationConfig``): a checkpoint's
``generation_config.json`` (repetition penalties, its own temperature and top-p) does not change
what the flags ask for. ``temperature: 0`` is greedy decoding; a seeded prompt draws the same
tokens whatever was generated before it (the generator is reseeded per prompt).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_mm.data.encode import EncodedSample
from mindspeed_mm.inference.loading import InferenceModel


@dataclass(frozen=True)
class SamplingSettings:
    """How to pick the next token.

    Attributes:
        max_new_tokens: tokens to generate per prompt at most.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k: sample among the k most likely tokens (0: all).
        top_p: sample among the most likely tokens whose probability reaches p (1: all).
        seed: seed of each prompt's random stream (None: torch's global generator goes on).
        ignore_eos: keep generating past the end-of-sequence token.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def check(self) -> None:
        """Raises ValueError naming the flag of a value out of range."""
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature} must be 0 (greedy) or more")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k} must be 0 (all tokens) or more")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p} must be in (0, 1]")


def eos_token_ids(loaded: InferenceModel) -> list[int]:
    """End-of-sequence ids: the generation config's, else the model config's, else the tokenizer's."""
    for holder in (
        getattr(loaded.model, "generation_config", None),
        loaded.model.config,
        getattr(loaded.model.config, "text_config", None),
    ):
        ids = getattr(holder, "eos_token_id", None) if holder is not None else None
        if ids is not None:
            return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
    return [int(loaded.tokenizer.eos_token_id)] if loaded.tokenizer.eos_token_id is not None else []


def generation_config(loaded: InferenceModel, settings: SamplingSettings) -> Any:
    """A ``GenerationConfig`` holding exactly the settings (no penalties from the checkpoint's file)."""
    from transformers import GenerationConfig

    eos = eos_token_ids(loaded)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    sample = settings.temperature > 0
    return GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=sample,
        temperature=settings.temperature if sample else None,
        top_k=(settings.top_k or None) if sample else None,
        top_p=settings.top_p if sample else None,
        eos_token_id=None if settings.ignore_eos else eos,
        pad_token_id=pad,
        use_cache=True,
    )


def model_inputs(encoded: EncodedSample, loaded: InferenceModel) -> dict[str, Any]:
    """Keyword arguments of the model's ``generate`` / forward for one prompt (a batch of one)."""
    ids = encoded.input_ids[None].to(loaded.device)
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "mm_token_type_ids" in inspect.signature(loaded.model.forward).parameters:  # M-RoPE families need them
        inputs["mm_token_type_ids"] = encoded.mm_token_type_ids[None].to(loaded.device)
    floating = next(loaded.model.parameters()).dtype
    for key, value in encoded.vision.items():
        inputs[key] = value.to(loaded.device, dtype=floating if value.is_floating_point() else value.dtype)
    return inputs


def generate_tokens(
    loaded: InferenceModel, encoded: EncodedSample, settings: SamplingSettings, streamer: Any = None
) -> list[int]:
    """The new token ids for one encoded prompt (the end-of-sequence token included when it ended the reply)."""
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    with torch.no_grad():
        out = loaded.model.generate(
            **model_inputs(encoded, loaded), generation_config=generation_config(loaded, settings), streamer=streamer
        )
    return [int(t) for t in out[0, encoded.input_ids.numel() :]]


class TextStreamer:
    """A transformers streamer that writes one reply's text as its tokens arrive.

    The whole reply is decoded each time (so characters split over tokens appear once complete);
    the first ``put`` (the prompt) is skipped.
    """

    def __init__(self, tokenizer: Any, write: Any) -> None:
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.shown = ""
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        """Called by ``generate`` with the prompt, then with each new token."""
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(int(t) for t in value.reshape(-1))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        if text.startswith(self.shown):
            self.write(text[len(self.shown) :])
        self.shown = text

    def end(self) -> None:
        """Called by ``generate`` once the reply is complete."""
        self.write("\n")


def batch_inputs(encoded: list[EncodedSample], loaded: InferenceModel) -> dict[str, Any]:
    """Keyword arguments of ``generate`` for several prompts: left-padded rows, their vision inputs concatenated."""
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    length = max(sample.input_ids.numel() for sample in encoded)
    ids = torch.full((len(encoded), length), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), length), dtype=torch.long)
    types = torch.zeros((len(encoded), length), dtype=torch.int32)
    vision: dict[str, list[torch.Tensor]] = {}
    for row, sample in enumerate(encoded):
        n = sample.input_ids.numel()
        ids[row, length - n :], mask[row, length - n :] = sample.input_ids, 1
        types[row, length - n :] = sample.mm_token_type_ids
        for key, value in sample.vision.items():
            vision.setdefault(key, []).append(value)
    inputs: dict[str, Any] = {"input_ids": ids.to(loaded.device), "attention_mask": mask.to(loaded.device)}
    if "mm_token_type_ids" in inspect.signature(loaded.model.forward).parameters:
        inputs["mm_token_type_ids"] = types.to(loaded.device)
    floating = next(loaded.model.parameters()).dtype
    for key, values in vision.items():
        value = torch.cat(values)
        inputs[key] = value.to(loaded.device, dtype=floating if value.is_floating_point() else value.dtype)
    return inputs


def generate_batch(loaded: InferenceModel, encoded: list[EncodedSample], settings: SamplingSettings) -> list[list[int]]:
    """The new token ids of several prompts decoded together (left padding), each cut after its end-of-sequence token.

    Greedy decoding gives each prompt the tokens it gets alone (``tests/mm/inference/test_generate.py``); a seeded
    sampling run repeats for the same batch (one random stream per batch).
    """
    if len(encoded) == 1:
        return [generate_tokens(loaded, encoded[0], settings)]
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    inputs = batch_inputs(encoded, loaded)
    with torch.no_grad():
        out = loaded.model.generate(**inputs, generation_config=generation_config(loaded, settings))
    eos = set() if settings.ignore_eos else set(eos_token_ids(loaded))
    replies = []
    for row in out[:, inputs["input_ids"].shape[1] :].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        replies.append([int(t) for t in row[:end]])
    return replies
