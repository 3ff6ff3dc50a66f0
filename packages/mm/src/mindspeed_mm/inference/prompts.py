"""Prompts of ``generate``: conversations with images, encoded exactly as the trainer encodes a sample.

A prompt is a conversation in mllm_format (``messages`` with ``<image>`` / ``<video>``
placeholders, plus ``images`` / ``videos``). Its tokens are those the trainer gives the same conversation up to the start of an
answer (:func:`mindspeed_mm.data.encode.encode_sample` with an empty last answer, cut where that
answer starts): the chat template rendered turn by turn with its generation prompt, each
``<image>`` expanded to the family's image tokens, the image processor's vision inputs and
``mm_token_type_ids``. A prompt whose last turn is the assistant's keeps that turn as the
reference answer (so a training or held-out file is a prompts file as it is).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mindspeed_mm.data.encode import IGNORE_INDEX, EncodedSample, encode_sample
from mindspeed_mm.data.mllm import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, MllmSample, read_mllm_files
from mindspeed_mm.inference.loading import InferenceModel


@dataclass(frozen=True)
class Prompt:
    """One conversation to continue.

    Attributes:
        messages: the turns, the last one the user's (``<image>`` / ``<video>`` placeholders in the contents).
        images: image paths, in placeholder order.
        reference: the assistant turn that followed in the prompts file (None: none).
        source: where it came from (``file:line``, or ``--prompt``).
        videos: videos (a file, a frame folder, or a tuple of frame paths), in placeholder order.
        audios: audio clips (.wav), in placeholder order (Qwen2.5-Omni).
    """

    messages: tuple[dict[str, str], ...]
    images: tuple[str, ...] = ()
    reference: str | None = None
    source: str = "--prompt"
    videos: tuple[str | tuple[str, ...], ...] = ()
    audios: tuple[str, ...] = ()


def prompt_from_text(
    text: str,
    images: list[str],
    system: str | None = None,
    videos: list[str] | tuple[str, ...] = (),
    audios: list[str] | tuple[str, ...] = (),
) -> Prompt:
    """A one-turn prompt; images (videos) without an ``<image>`` (``<video>``) in ``text`` are put before it,
    images first, then videos, then audio clips (as LLaMA-Factory does).

    Raises:
        ValueError: an image or video that does not exist, or placeholders that do not match them.
    """
    for image in images:
        if not Path(image).is_file():
            raise ValueError(f"--image {image!r} does not exist; give the path of an image file")
    for video in videos:
        if not Path(video).exists():
            raise ValueError(f"--video {video!r} does not exist; give a video file or a folder of frame images")
    for audio in audios:
        if not Path(audio).is_file():
            raise ValueError(f"--audio {audio!r} does not exist; give the path of a .wav file")
    prefix = ""
    for placeholder, flag, media in (
        (IMAGE_PLACEHOLDER, "--image", images),
        (VIDEO_PLACEHOLDER, "--video", videos),
        (AUDIO_PLACEHOLDER, "--audio", audios),
    ):
        placeholders = text.count(placeholder)
        if placeholders == 0:
            prefix += placeholder * len(media)
        elif placeholders != len(media):
            raise ValueError(
                f"--prompt has {placeholders} {placeholder} placeholder(s) but {len(media)} {flag}; give one "
                f"{flag} per placeholder (or no placeholder: they go first)"
            )
    text = prefix + text
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return Prompt(
        messages=tuple(messages),
        images=tuple(str(Path(i).resolve()) for i in images),
        videos=tuple(str(Path(v).resolve()) for v in videos),
        audios=tuple(str(Path(a).resolve()) for a in audios),
    )


def read_prompt_file(path: str | Path, image_dir: str | None = None, max_samples: int | None = None) -> list[Prompt]:
    """Prompts of an mllm_format ``.jsonl`` / ``.json`` file; a last assistant turn becomes the reference.

    Raises:
        ValueError: a missing file or a malformed sample (file, line and fix).
    """
    if not Path(path).is_file():
        raise ValueError(f"--prompts-file {str(path)!r} does not exist; give an mllm_format .jsonl or .json file")
    prompts = []
    for sample in read_mllm_files([str(path)], image_dir, max_samples, require_answer=False):
        messages, reference = sample.messages, None
        if messages[-1]["role"] == "assistant":
            messages, reference = messages[:-1], messages[-1]["content"]
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(
                f"{sample.source}: the conversation must end with a user turn (optionally followed by "
                "the reference answer); add the question"
            )
        prompts.append(
            Prompt(
                messages=messages,
                images=sample.images,
                reference=reference,
                source=sample.source,
                videos=sample.videos,
                audios=sample.audios,
            )
        )
    return prompts


def encode_prompt(prompt: Prompt, loaded: InferenceModel, max_len: int = 1 << 30) -> EncodedSample:
    """The prompt's tokens up to the start of the answer, its vision inputs and ``mm_token_type_ids``.

    Raises:
        ValueError: an image that cannot be read, or a chat template that does not render turn by turn.
    """
    return encode_with_answer(prompt, "", loaded, max_len)[0]


def encode_with_answer(
    prompt: Prompt, answer: str, loaded: InferenceModel, max_len: int = 1 << 30
) -> tuple[EncodedSample, EncodedSample]:
    """``(prompt part, whole sample)`` of the conversation followed by the assistant turn ``answer``.

    The whole sample's labels are the answer's tokens (the template's end of turn included), as the
    trainer labels them; the prompt part is the whole sample cut where the answer starts.
    """
    messages = prompt.messages + ({"role": "assistant", "content": answer},)
    whole = encode_sample(
        MllmSample(messages, prompt.images, prompt.source, prompt.videos, prompt.audios),
        loaded.tokenizer,
        loaded.processor,
        loaded.family,
        max_len,
        mask_history=True,
        video_processor=loaded.video_processor() if prompt.videos else None,
        video_settings=loaded.video_settings,
        audio_processor=loaded.audio_processor() if prompt.audios else None,
    )
    learned = (whole.labels != IGNORE_INDEX).nonzero()
    start = int(learned[0]) if len(learned) else whole.input_ids.numel()
    part = EncodedSample(
        input_ids=whole.input_ids[:start],
        labels=torch.full((start,), IGNORE_INDEX),
        mm_token_type_ids=whole.mm_token_type_ids[:start],
        vision=whole.vision,
        source=whole.source,
    )
    return part, whole
