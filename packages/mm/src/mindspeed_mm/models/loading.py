"""Loading a family's model, tokenizer and image processor from a local directory, and freezing parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mindspeed.log import DETAIL, get_logger
from mindspeed_mm.config import PARTS
from mindspeed_mm.models.attention import ATTENTION_NAME, register_attention, use_varlen_vision
from mindspeed_mm.models.family import VLMFamily
from mindspeed_mm.models.patch_linear import use_linear_patches

logger = get_logger(__name__)


def load_model(path: str | Path, family: VLMFamily, attn_implementation: str = "mindspeed") -> Any:
    """The family's transformers model with the weights of ``path``, in fp32 (the master copy FSDP2 shards).

    ``mindspeed`` attention (:mod:`mindspeed_mm.models.attention`) is registered with transformers first.
    With it the model gets the suite's speed-ups through seams (:func:`_speed_up`); another
    name (``sdpa``, ``eager``: the references of the tests) leaves the model as transformers builds it.
    """
    register_attention()
    cls = family.load_class()
    model = cls.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=attn_implementation, local_files_only=True
    )
    model.config.use_cache = False  # training: no KV cache (and packed masks need none)
    _speed_up(model, attn_implementation)
    # transformers' "Loading weights" bar is off on a quiet console (mindspeed.log): the report says it
    logger.info("loaded %s from %s (%d tensors)", cls.__name__, path, len(model.state_dict()), extra=DETAIL)
    return model


def build_meta_model(path: str | Path, family: VLMFamily, attn_implementation: str = "mindspeed") -> Any:
    """The family's model with the configuration of ``path`` on the meta device (no memory, no weights)."""
    from transformers import AutoConfig

    register_attention()
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = family.load_class()._from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    model.config.use_cache = False
    _speed_up(model, attn_implementation)
    return model


def _speed_up(model: torch.nn.Module, attn_implementation: str) -> None:
    """With ``mindspeed`` attention: the vision tower's windows in one varlen call
    (:func:`~mindspeed_mm.models.attention.use_varlen_vision`) and its patch embedding as a matmul
    (:func:`~mindspeed_mm.models.patch_linear.use_linear_patches`); same parameters, same numbers."""
    if attn_implementation != ATTENTION_NAME:
        return
    use_varlen_vision(model)
    use_linear_patches(model)


def load_processing(path: str | Path, min_pixels: int, max_pixels: int) -> tuple[Any, Any]:
    """The tokenizer (with its chat template) and the image processor of ``path``, images kept within the pixel bounds.

    The image processor gets ``image_seq_length`` from config.json when the model has one
    (InternVL: image tokens per tile).

    Raises:
        ValueError: the directory lacks a chat template.
    """
    import json

    from transformers import AutoImageProcessor, AutoTokenizer

    from mindspeed_mm.models.family import family_of

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{path}: the tokenizer has no chat template; add chat_template.jinja (or the "
            "tokenizer_config.json entry) to the model directory"
        )
    processor = AutoImageProcessor.from_pretrained(
        str(path), local_files_only=True, **family_of(path).processor_overrides(min_pixels, max_pixels)
    )
    seq_length = json.loads((Path(path) / "config.json").read_text()).get("image_seq_length")
    if seq_length is not None:
        processor.image_seq_length = int(seq_length)
    return tokenizer, processor


def load_video_processor(path: str | Path) -> Any:
    """The video processor of ``path`` (``video_preprocessor_config.json``), with InternVL's ``image_seq_length``.

    Raises:
        ValueError: the family takes no videos, or the directory has no video processor.
    """
    import json

    from transformers import AutoVideoProcessor

    from mindspeed_mm.models.family import family_of

    family = family_of(path)
    if family.video_inputs is None:
        raise ValueError(f"{family.architecture} takes no videos; remove the <video> samples or use a video model")
    try:
        processor = AutoVideoProcessor.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{path}: no video processor could be loaded ({err}); add the model's video_preprocessor_config.json"
        ) from err
    seq_length = json.loads((Path(path) / "config.json").read_text()).get("image_seq_length")
    if seq_length is not None:
        processor.image_seq_length = int(seq_length)
    return processor


def load_audio_processor(path: str | Path) -> Any:
    """The audio feature extractor of ``path`` (``audio_processor/preprocessor_config.json``, else the
    directory's own ``preprocessor_config.json`` when it is a feature extractor's).

    Raises:
        ValueError: the family takes no audio, or the directory has no feature extractor.
    """
    import json

    from transformers import AutoFeatureExtractor

    from mindspeed_mm.models.family import family_of

    family = family_of(path)
    if family.audio_inputs is None:
        raise ValueError(f"{family.architecture} takes no audio; remove the <audio> samples or use Qwen2.5-Omni")
    for folder in (Path(path) / "audio_processor", Path(path)):
        config = folder / "preprocessor_config.json"
        if config.is_file() and "feature_extractor_type" in json.loads(config.read_text()):
            return AutoFeatureExtractor.from_pretrained(str(folder), local_files_only=True)
    raise ValueError(
        f"{path}: no audio feature extractor; add audio_processor/preprocessor_config.json "
        "(a WhisperFeatureExtractor's, as Qwen2.5-Omni ships it)"
    )


def freeze_parts(model: torch.nn.Module, family: VLMFamily, freeze: list[str]) -> list[str]:
    """Turn off the gradients of the named parts (or module-name prefixes); returns the frozen parameter names.

    Raises:
        ValueError: a name that is neither a part of the family nor a prefix of any parameter.
    """
    prefixes: list[str] = []
    for name in freeze:
        if name in family.parts:
            prefixes.extend(family.parts[name])
        else:
            prefixes.append(name)
    names = [name for name, _ in model.named_parameters()]
    for prefix, item in zip(prefixes, [p for name in freeze for p in ([name] * len(family.parts.get(name, (name,))))]):
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            raise ValueError(
                f"model.freeze: {item!r} matches no parameter of {family.architecture}; use one of "
                f"{', '.join(PARTS)} or a module-name prefix such as {names[0].rsplit('.', 2)[0]!r}"
            )
    frozen = []
    for name, param in model.named_parameters():
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            param.requires_grad_(False)
            frozen.append(name)
    if frozen:
        logger.info(
            "frozen: %s (%d tensors, %.3f M parameters)",
            ", ".join(freeze),
            len(frozen),
            sum(p.numel() for p in model.parameters() if not p.requires_grad) / 1e6,
        )
    return frozen
