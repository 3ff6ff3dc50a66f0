"""``mindspeed-mm generate``: answer questions about images with a vision-language model, or sample a DiT.

A diffusers ``--load-dir`` (pipeline, transformer directory, or a DiT training checkpoint with a
diffusers ``--base-dir``) is handed to :mod:`mindspeed_mm.dit_generate`, which writes pictures
and videos; everything below is about vision-language models.

The model comes from a Hugging Face directory or a ``mindspeed-mm train`` checkpoint (torch DCP,
with ``--base-dir``), the prompts from ``--prompt`` (with ``--image``), an mllm_format
``--prompts-file``, or a conversation (``--chat`` without prompts: in a terminal, or a user turn
per line of a pipe). Every prompt goes through the model's chat template and image processor as
the trainer encodes a sample; the tokens come from the transformers model's own ``generate``.
Bad input ends with one line on standard error and exit status 2 before anything is generated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger
from mindspeed.suite_cli import add_dataclass_flags, add_renamed_flag
from mindspeed_mm.dit_generate import DiTSampleConfig

logger = get_logger(__name__)


@dataclass(kw_only=True)
class GenerateConfig:
    """Every ``generate`` option besides ``--prompt``, ``--image`` and ``--video`` (the CLI flags are these names with dashes).

    Attributes:
        load_dir: the model: a Hugging Face directory, a mindspeed-mm training checkpoint (checkpoint.save
            or one of its step_* folders; needs --base-dir), a PEFT LoRA adapter (merged into its base), or
            demo (the demo's untrained model).
        base_dir: the Hugging Face directory a training checkpoint was trained from (config, tokenizer,
            image processor, chat template); demo for the demo model.
        prompts_file: mllm_format .jsonl / .json prompts (messages with <image> placeholders plus images;
            a last assistant turn is kept as the reference answer).
        image_dir: folder the prompts file's image paths are relative to (default: the file's folder).
        max_samples: the first N prompts of --prompts-file only.
        chat: without prompts, a conversation: interactive in a terminal, else a user turn per line of
            standard input until its end (--image goes with the first turn).
        system: system message put first in every conversation built from --prompt or --chat.
        max_new_tokens: tokens to generate per prompt at most.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k: sample among the k most likely tokens (0: all).
        top_p: sample among the most likely tokens whose probability reaches p (1: all).
        seed: seed of each prompt's random stream (sampling is repeatable with it).
        ignore_eos: keep generating past the end-of-sequence token.
        batch_size: prompts decoded together (left-padded); greedy replies do not depend on it, a seeded
            sampling run repeats for the same batch size (1: every prompt its own seeded stream).
        image_min_pixels: images are resized to at least this many pixels.
        image_max_pixels: and to at most this many (use the values the model was trained with).
        video_fps: video frames sampled per second (data.video_fps of the training recipe).
        video_maxlen: at most this many frames per video.
        video_max_pixels: video frames are resized to at most this many pixels.
        video_min_pixels: and to at least this many.
        dtype: float32, bfloat16 or float16 (default: the directory's; float32 for a training checkpoint).
        lora_alpha: the recipe's lora.alpha, to merge a LoRA run's training checkpoint moved away from
            its save folder (default: the alpha the run recorded there).
        output: write the results here as JSON Lines (messages, completion, token ids, reference).
        stream: print a single prompt's reply as it is produced.
    """

    load_dir: str
    base_dir: str | None = None
    prompts_file: str | None = None
    image_dir: str | None = None
    max_samples: int | None = None
    chat: bool = False
    system: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    batch_size: int = 8
    image_min_pixels: int = 3136
    image_max_pixels: int = 262144
    video_fps: float = 2.0
    video_maxlen: int = 128
    video_max_pixels: int = 65536
    video_min_pixels: int = 256
    dtype: str | None = None
    lora_alpha: float | None = None
    output: str | None = None
    stream: bool = True


def add_generate(sub: argparse._SubParsersAction) -> None:
    """Add ``generate`` to the ``mindspeed-mm`` subcommands."""
    parser = sub.add_parser(
        "generate",
        help="answer questions about images (Hugging Face directory or training checkpoint)",
        description="Generate replies of a vision-language model to prompts with images: --prompt TEXT --image "
        "FILE (repeatable), an mllm_format --prompts-file, or a --chat conversation (a turn per line "
        "when standard input is a pipe). One prompt streams to the terminal. Greedy by default; "
        "--temperature/--top-k/--top-p/--seed sample.",
    )
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image for every --prompt (repeatable; put <image> in the prompt where it goes, "
        "else the images come first); for an image-to-video diffusion transformer (Wan I2V): the first frame, "
        "one for every prompt or one per prompt; for an image-editing one (Qwen-Image-Edit): the image to edit",
    )
    parser.add_argument(
        "--last-image",
        action="append",
        default=[],
        metavar="FILE",
        help="for a first-last-frame-to-video diffusion transformer (Wan FLF2V): the last frame, one for every "
        "prompt or one per prompt (as --image)",
    )
    parser.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="FILE",
        help="a video (a file or a folder of frame images) for every --prompt (repeatable; put <video> in the "
        "prompt where it goes, else the videos come first, after the images)",
    )
    parser.add_argument(
        "--audio",
        action="append",
        default=[],
        metavar="FILE",
        help="an audio clip (.wav) for every --prompt, for a model that takes audio (Qwen2.5-Omni) (repeatable; "
        "put <audio> in the prompt where it goes, else the clips come first, after the images and videos)",
    )
    add_dataclass_flags(parser, GenerateConfig)
    add_renamed_flag(parser, "--hf-cfg-dir", "--base-dir")  # its earlier name (mindspeed-llm's spelling)
    dit = parser.add_argument_group("diffusion transformers (a diffusers --load-dir: text to video / image files)")
    add_dataclass_flags(dit, DiTSampleConfig, choices={"sampler": ["euler", "unipc"]})
    parser.set_defaults(func=run_generate)


def _config(args: argparse.Namespace, cls: type = GenerateConfig) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def run_generate(args: argparse.Namespace) -> int:
    """Run ``generate`` from parsed arguments; returns the exit status."""
    # Lazy: keeps torch and transformers out of the start-up of mindspeed_mm.cli.
    from mindspeed_mm.demos.names import resolve_demo_dir, resolve_model_dir
    from mindspeed_mm.inference import SamplingSettings, load_inference_model, prompt_from_text, read_prompt_file
    from mindspeed_mm.inference.dit_pipeline import is_dit_source

    for name in ("load_dir", "base_dir", "pipeline_dir"):  # demo-t2v / demo-t2i: a diffusion demo's pipeline
        if hasattr(args, name):
            setattr(args, name, resolve_demo_dir(getattr(args, name)))
    if is_dit_source(args.load_dir, args.base_dir):  # a diffusers model: text to video / image files
        from mindspeed_mm.dit_generate import run_dit_generate

        return run_dit_generate(args, _config(args, DiTSampleConfig))
    from mindspeed_mm.data.video import VideoSettings

    config = _config(args)
    settings = SamplingSettings(
        config.max_new_tokens, config.temperature, config.top_k, config.top_p, config.seed, config.ignore_eos
    )
    settings.check()
    if config.batch_size < 1:
        raise ValueError(f"--batch-size {config.batch_size} must be at least 1")
    prompts = [prompt_from_text(text, args.image, config.system, args.video, args.audio) for text in args.prompt]
    if config.prompts_file is not None:
        prompts += read_prompt_file(config.prompts_file, config.image_dir, config.max_samples)
    conversation = not prompts and config.chat
    if not prompts and not conversation:
        raise ValueError("nothing to generate: give --prompt TEXT (with --image FILE), --prompts-file FILE, or --chat")
    if conversation:
        prompt_from_text("", args.image, None, args.video, args.audio)  # the same checks of the media flags
    if config.output is not None and Path(config.output).is_dir():
        raise ValueError(f"--output {config.output} is a directory; give a file name")
    loaded = load_inference_model(
        resolve_model_dir(config.load_dir),  # demo: the vision-language demo's model
        resolve_model_dir(config.base_dir),
        config.dtype,
        config.image_min_pixels,
        config.image_max_pixels,
        config.lora_alpha,
        VideoSettings(config.video_fps, config.video_maxlen, config.video_max_pixels, config.video_min_pixels),
    )
    if conversation:
        return _chat_loop(loaded, settings, config, args.image, sys.stdin.isatty(), args.video, args.audio)
    return _generate_all(loaded, prompts, settings, config)


def _generate_all(loaded: Any, prompts: list[Any], settings: Any, config: GenerateConfig) -> int:
    from mindspeed_mm.inference import TextStreamer, encode_prompt, generate_tokens
    from mindspeed_mm.inference.generation import generate_batch

    encoded = [encode_prompt(prompt, loaded) for prompt in prompts]  # every prompt checked before generating
    started = time.perf_counter()
    if config.stream and len(prompts) == 1:
        replies = [generate_tokens(loaded, encoded[0], settings, TextStreamer(loaded.tokenizer, _write))]
    else:
        replies = []
        for start in range(0, len(encoded), config.batch_size):
            replies += generate_batch(loaded, encoded[start : start + config.batch_size], settings)
    rows = []
    for index, (prompt, sample, tokens) in enumerate(zip(prompts, encoded, replies)):
        text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        reason = "stop" if tokens and not settings.ignore_eos and tokens[-1] in _eos(loaded) else "length"
        if not (config.stream and len(prompts) == 1):
            reference = f"\n--- reference {index} ---\n{prompt.reference}" if prompt.reference is not None else ""
            _write(
                f"--- prompt {index} ({prompt.source}) ---\n{prompt.messages[-1]['content']}\n"
                f"--- completion {index} ({reason}, {len(tokens)} tokens) ---\n{text}{reference}\n"
            )
        rows.append(
            {
                "index": index,
                "source": prompt.source,
                "messages": list(prompt.messages),
                "images": list(prompt.images),
                "videos": [v if isinstance(v, str) else list(v) for v in prompt.videos],
                "completion": text,
                "prompt_token_ids": sample.input_ids.tolist(),
                "token_ids": tokens,
                "finish_reason": reason,
                "reference": prompt.reference,
            }
        )
    elapsed = time.perf_counter() - started
    if config.output is not None:
        _write_jsonl(Path(config.output), rows)
    generated = sum(len(row["token_ids"]) for row in rows)
    logger.info(
        "generate: %d prompts, %d tokens in %.2f s (%.1f tokens/s)%s",
        len(rows),
        generated,
        elapsed,
        generated / max(elapsed, 1e-9),
        f"; wrote {config.output}" if config.output else "",
    )
    return 0


def _eos(loaded: Any) -> list[int]:
    from mindspeed_mm.inference.generation import eos_token_ids

    return eos_token_ids(loaded)


def _next_turn(interactive: bool) -> str | None:
    """The user's next line; ``None`` at the end (EOF, or an empty line in a terminal)."""
    if interactive:
        try:
            line = input("you> ").strip()
        except EOFError:
            _write("\n")
            return None
        return line or None
    while line := sys.stdin.readline():  # a pipe: every non-empty line is a turn, until EOF
        if line.strip():
            return line.strip()
    return None


def _chat_loop(
    loaded: Any,
    settings: Any,
    config: GenerateConfig,
    images: list[str],
    interactive: bool,
    videos: list[str] = (),
    audios: list[str] = (),
) -> int:
    """One conversation, a turn per line (``you>`` / ``model>`` in a terminal; from a pipe the replies are
    printed one per line). ``--image``, ``--video`` and ``--audio`` go with the first turn; ``/reset`` starts over."""
    from mindspeed_mm.inference import TextStreamer, encode_prompt, generate_tokens, prompt_from_text
    from mindspeed_mm.inference.prompts import Prompt

    if interactive:
        _write("chat with the model: an empty line or /exit ends, /reset clears the conversation\n")
    conversation: Prompt | None = None
    while True:
        line = _next_turn(interactive)
        if line is None or line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            conversation = None
            continue
        if conversation is None:
            turn = prompt_from_text(line, images, config.system, videos, audios)
        elif "<image>" in line or "<video>" in line:
            _write("(error: images and videos go with the first turn (--image, --video); ask without them)\n")
            continue
        else:
            turn = dataclasses.replace(
                conversation, messages=conversation.messages + ({"role": "user", "content": line},)
            )
        try:
            encoded = encode_prompt(turn, loaded)
        except ValueError as err:  # e.g. a stray <image> in a later turn: say so, keep the session
            _write(f"(error: {err})\n")
            continue
        if interactive:
            _write("model> ")
        tokens = generate_tokens(loaded, encoded, settings, TextStreamer(loaded.tokenizer, _write))
        reply = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        conversation = dataclasses.replace(turn, messages=turn.messages + ({"role": "assistant", "content": reply},))


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    # Temporary name then rename: an interrupted run never leaves half a file under the real name.
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with open(temp, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(temp, path)
