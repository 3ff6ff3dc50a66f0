"""Encoding one mllm_format sample with the model's tokenizer, chat template and image processor.

The conversation is rendered with the tokenizer's chat template one turn at a time (the text of
the first k turns is a prefix of the text of the first k + 1), so each assistant answer is a
known span: its tokens are the labels, everything else is -100 (``train_on_prompt`` labels the
prompts too, ``mask_history`` only the last answer). ``<image>`` becomes the family's
placeholder, whose image token is then repeated as many times as the family's processor
does (once per merged patch for Qwen-VL, ``image_seq_length`` per tile for InternVL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_mm.data.mllm import IMAGE_PLACEHOLDER, MllmSample
from mindspeed_mm.models.family import VLMFamily

IGNORE_INDEX = -100


@dataclass
class EncodedSample:
    """One sample ready to pack.

    Attributes:
        input_ids: [L] token ids.
        labels: [L] the token itself where it is learned, -100 elsewhere (not shifted).
        mm_token_type_ids: [L] 0 text, 1 image token.
        vision: the model's vision inputs (``pixel_values``, and ``image_grid_thw`` for Qwen-VL); empty: no images.
        source: where the sample came from.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    mm_token_type_ids: torch.Tensor
    vision: dict[str, torch.Tensor]
    source: str

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """The image input (None: no images)."""
        return self.vision.get("pixel_values")

    @property
    def num_label_tokens(self) -> int:
        """Tokens that are predicted (labels after the shift that are not -100)."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


def _segments(messages: list[dict[str, str]], tokenizer: Any, source: str) -> list[tuple[str, str]]:
    """``[(kind, text)]`` with kind ``prompt`` or ``answer``, concatenating to the whole rendered conversation."""

    def render(k: int, generation: bool) -> str:
        return tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=generation)

    segments: list[tuple[str, str]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, full = render(i, True), render(i + 1, False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ValueError(
                f"{source}: the chat template does not render turn by turn (a conversation's text "
                "is not a prefix of the next one's); use a template that only appends per turn"
            )
        segments += [("prompt", prompt[len(done) :]), ("answer", full[len(prompt) :])]
        done = full
    rest = render(len(messages), False)[len(done) :]
    if rest:
        segments.append(("prompt", rest))
    return segments


def encode_sample(
    sample: MllmSample,
    tokenizer: Any,
    image_processor: Any,
    family: VLMFamily,
    cutoff_len: int,
    train_on_prompt: bool = False,
    mask_history: bool = False,
) -> EncodedSample:
    """Tokenize ``sample`` and process its images.

    Raises:
        ValueError: the sample's image tokens do not fit in ``cutoff_len`` or an image cannot be read.
    """
    from PIL import Image

    vision: dict[str, torch.Tensor] = {}
    counts: list[int] = []
    if sample.images:
        images = []
        for path in sample.images:
            try:
                with Image.open(path) as image:
                    images.append(image.convert("RGB"))
            except OSError as err:
                raise ValueError(f"{sample.source}: image {path} cannot be read ({err}); fix or remove it") from err
        vision, counts = family.image_inputs(image_processor(images=images, return_tensors="pt"), image_processor)
    messages = [
        {"role": m["role"], "content": m["content"].replace(IMAGE_PLACEHOLDER, family.image_placeholder)}
        for m in sample.messages
    ]
    segments = _segments(messages, tokenizer, sample.source)
    answers = [i for i, (kind, _) in enumerate(segments) if kind == "answer"]
    ids: list[int] = []
    labels: list[int] = []
    next_image = 0
    for i, (kind, text) in enumerate(segments):
        pieces = text.split(family.image_token)
        expanded = pieces[0]
        for piece in pieces[1:]:
            expanded += family.image_token * counts[next_image] + piece
            next_image += 1
        tokens = tokenizer(expanded, add_special_tokens=False)["input_ids"]
        learned = (kind == "answer" and (not mask_history or i == answers[-1])) or (
            train_on_prompt and kind == "prompt"
        )
        ids += tokens
        labels += tokens if learned else [IGNORE_INDEX] * len(tokens)
    image_id = tokenizer.convert_tokens_to_ids(family.image_token)
    input_ids = torch.tensor(ids, dtype=torch.long)
    image_positions = (input_ids == image_id).nonzero()
    if len(image_positions) and int(image_positions[-1]) >= cutoff_len:
        raise ValueError(
            f"{sample.source}: its image tokens end at token {int(image_positions[-1]) + 1}, beyond "
            f"data.cutoff_len={cutoff_len}; raise data.cutoff_len or lower data.image_max_pixels"
        )
    input_ids, target = input_ids[:cutoff_len], torch.tensor(labels[:cutoff_len], dtype=torch.long)
    return EncodedSample(
        input_ids=input_ids,
        labels=target,
        mm_token_type_ids=(input_ids == image_id).to(torch.int32),
        vision=vision,
        source=sample.source,
    )
