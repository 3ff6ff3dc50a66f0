"""Encoding one mllm_format sample with the model's tokenizer, chat template, image and video processors.

The conversation is rendered with the tokenizer's chat template one turn at a time (the text of
the first k turns is a prefix of the text of the first k + 1), so each assistant answer is a
known span: its tokens are the labels, everything else is -100 (``train_on_prompt`` labels the
prompts too, ``mask_history`` only the last answer). ``<image>`` becomes the family's
placeholder, whose image token is then repeated as many times as the family's processor
does (once per merged patch for Qwen-VL, ``image_seq_length`` per tile for InternVL). ``<video>``
becomes the family's video placeholder, whose video token is replaced by the text the family's
processor puts there (:attr:`~mindspeed_mm.models.family.VLMFamily.video_inputs`: merged patches
for Qwen2.5-VL, timestamped frames for Qwen3-VL, ``Frame{i}:`` tiles for InternVL); videos are
decoded by :mod:`mindspeed_mm.data.video`. ``<audio>`` becomes the family's audio placeholder
(Qwen2.5-Omni), whose audio token is repeated once per audio encoder frame; clips are decoded by
:mod:`mindspeed_mm.data.audio` at the feature extractor's rate and go through it one by one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_mm.data.audio import decode_audio
from mindspeed_mm.data.mllm import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, MllmSample
from mindspeed_mm.data.video import VideoSettings, decode_video
from mindspeed_mm.models.family import VLMFamily

IGNORE_INDEX = -100


@dataclass
class EncodedSample:
    """One sample ready to pack.

    Attributes:
        input_ids: [L] token ids.
        labels: [L] the token itself where it is learned, -100 elsewhere (not shifted).
        mm_token_type_ids: [L] 0 text, 1 image token, 2 video token, 3 audio token.
        vision: the model's vision inputs (``pixel_values``, and ``image_grid_thw`` for Qwen-VL; videos:
            ``pixel_values_videos``, ``video_grid_thw`` (and ``second_per_grid_ts``), InternVL's frames in
            ``pixel_values``; audio: ``input_features``, ``feature_attention_mask``); empty: no media.
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
    video_processor: Any = None,
    video_settings: VideoSettings | None = None,
    audio_processor: Any = None,
) -> EncodedSample:
    """Tokenize ``sample``, process its images and decode and process its videos.

    Each image (video) goes through the image (video) processor on its own; the vision inputs are
    concatenated in the order the placeholders appear (InternVL's frames and tiles share
    ``pixel_values`` in that order, as its processor puts them).

    Raises:
        ValueError: the sample's image or video tokens do not fit in ``cutoff_len``, or a medium cannot be read.
    """
    from PIL import Image

    pieces: list[dict[str, torch.Tensor]] = []
    texts: dict[str, list[str]] = {"image": [], "video": [], "audio": []}
    counters = {"image": 0, "video": 0, "audio": 0}
    for kind in _media_order(sample):
        index = counters[kind]
        counters[kind] += 1
        if kind == "image":
            path = sample.images[index]
            try:
                with Image.open(path) as image:
                    image = image.convert("RGB")
            except OSError as err:
                raise ValueError(f"{sample.source}: image {path} cannot be read ({err}); fix or remove it") from err
            vision, counts = family.image_inputs(image_processor(images=[image], return_tensors="pt"), image_processor)
            texts["image"].append(family.image_token * counts[0])
        elif kind == "audio":
            if family.audio_inputs is None or audio_processor is None:
                raise ValueError(
                    f"{sample.source}: an <audio> sample, but {family.architecture} takes no audio here; "
                    "remove the sample or use a model with a feature extractor (Qwen2.5-Omni)"
                )
            rate = int(audio_processor.sampling_rate)
            waveform = decode_audio(sample.audios[index], rate, sample.source)
            out = audio_processor(
                [waveform], sampling_rate=rate, padding="max_length", return_attention_mask=True, return_tensors="pt"
            )
            vision, counts = family.audio_inputs(out)
            texts["audio"].append(family.audio_token * counts[0])
        else:
            if family.video_inputs is None or video_processor is None:
                raise ValueError(
                    f"{sample.source}: a <video> sample, but {family.architecture} takes no videos here; "
                    "remove the sample or use a model with a video processor"
                )
            clip = decode_video(sample.videos[index], video_settings or VideoSettings(), sample.source)
            out = video_processor(
                videos=[clip.frames],
                video_metadata=[clip.metadata()],
                do_sample_frames=False,
                return_metadata=True,
                return_tensors="pt",
            )
            vision, replacements = family.video_inputs(out, video_processor)
            texts["video"].append(replacements[0])
        pieces.append(vision)
    keys = list(dict.fromkeys(key for piece in pieces for key in piece))  # first-seen order
    vision = {key: torch.cat([piece[key] for piece in pieces if key in piece]) for key in keys}
    messages = [
        {
            "role": m["role"],
            "content": m["content"]
            .replace(IMAGE_PLACEHOLDER, family.image_placeholder)
            .replace(VIDEO_PLACEHOLDER, family.video_placeholder or VIDEO_PLACEHOLDER)
            .replace(AUDIO_PLACEHOLDER, family.audio_placeholder or AUDIO_PLACEHOLDER),
        }
        for m in sample.messages
    ]
    segments = _segments(messages, tokenizer, sample.source)
    answers = [i for i, (kind, _) in enumerate(segments) if kind == "answer"]
    tokens_of = {family.image_token: "image"}
    if family.video_token:
        tokens_of[family.video_token] = "video"
    if family.audio_token:
        tokens_of[family.audio_token] = "audio"
    pattern = re.compile("|".join(re.escape(token) for token in tokens_of))
    ids: list[int] = []
    labels: list[int] = []
    taken = {"image": 0, "video": 0, "audio": 0}
    for i, (kind, text) in enumerate(segments):
        expanded, at = "", 0
        for match in pattern.finditer(text):
            medium = tokens_of[match.group()]
            expanded += text[at : match.start()] + texts[medium][taken[medium]]
            taken[medium] += 1
            at = match.end()
        tokens = tokenizer(expanded + text[at:], add_special_tokens=False)["input_ids"]
        learned = (kind == "answer" and (not mask_history or i == answers[-1])) or (
            train_on_prompt and kind == "prompt"
        )
        ids += tokens
        labels += tokens if learned else [IGNORE_INDEX] * len(tokens)
    input_ids = torch.tensor(ids, dtype=torch.long)
    types = (input_ids == tokenizer.convert_tokens_to_ids(family.image_token)).to(torch.int32)
    if any(family.video_token in text for text in texts["video"]):  # Qwen-VL's video tokens (InternVL's are tiles)
        types[input_ids == tokenizer.convert_tokens_to_ids(family.video_token)] = 2
    if family.audio_token:
        types[input_ids == tokenizer.convert_tokens_to_ids(family.audio_token)] = 3
    media_positions = types.nonzero()
    if len(media_positions) and int(media_positions[-1]) >= cutoff_len:
        raise ValueError(
            f"{sample.source}: its image/video/audio tokens end at token {int(media_positions[-1]) + 1}, beyond "
            f"data.cutoff_len={cutoff_len}; raise data.cutoff_len or lower data.image_max_pixels "
            "(data.video_max_pixels, data.video_maxlen; shorter audio clips)"
        )
    input_ids, target = input_ids[:cutoff_len], torch.tensor(labels[:cutoff_len], dtype=torch.long)
    return EncodedSample(
        input_ids=input_ids, labels=target, mm_token_type_ids=types[:cutoff_len], vision=vision, source=sample.source
    )


def _media_order(sample: MllmSample) -> list[str]:
    """``"image"`` / ``"video"`` / ``"audio"`` in the order the placeholders appear in the messages."""
    kinds = {IMAGE_PLACEHOLDER: "image", VIDEO_PLACEHOLDER: "video", AUDIO_PLACEHOLDER: "audio"}
    pattern = re.compile("|".join(re.escape(placeholder) for placeholder in kinds))
    return [kinds[match.group()] for message in sample.messages for match in pattern.finditer(message["content"])]
