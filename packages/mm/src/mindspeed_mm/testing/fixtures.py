"""A tiny model directory of a registered family and a small image-question data set, built in code (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mindspeed_mm.models.family import FAMILIES


def write_tiny_model(
    directory: str | Path, architecture: str = "Qwen2_5_VLForConditionalGeneration", seed: int = 0
) -> Path:
    """Write the family's tiny model (config, random weights, tokenizer, image processor) into ``directory``."""
    directory = Path(directory)
    FAMILIES.get(architecture).write_tiny(directory, seed)
    return directory


def write_tiny_dataset(directory: str | Path, num_samples: int = 8, seed: int = 0, text_only_every: int = 4) -> Path:
    """``directory/data.jsonl`` plus PNG images: "What colour is the square?" style samples.

    Every ``text_only_every``-th sample has no image; sizes vary so the patch grids differ.
    """
    from PIL import Image

    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    lines = []
    for i in range(num_samples):
        name = list(colours)[i % 3]
        if text_only_every and i % text_only_every == text_only_every - 1:
            lines.append(
                {"messages": [{"role": "user", "content": f"Say {name}."}, {"role": "assistant", "content": name}]}
            )
            continue
        height, width = (int(x) for x in rng.choice([28, 56, 84], size=2))
        pixels = np.clip(np.array(colours[name]) + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
        path = directory / "images" / f"{i:04d}.png"
        Image.fromarray(pixels).save(path)
        lines.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>What colour is it?"},
                    {"role": "assistant", "content": f"It is {name}."},
                ],
                "images": [f"images/{path.name}"],
            }
        )
    target = directory / "data.jsonl"
    target.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return target


def write_mp4(path: str | Path, frames: np.ndarray, fps: int) -> Path:
    """Write uint8 ``[F, H, W, 3]`` frames (even sizes) as an H.264 .mp4 with PyAV."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def moving_bar(frames: int, height: int, width: int, colour: tuple[int, int, int]) -> np.ndarray:
    """``[F, H, W, 3]`` uint8: a bar of ``colour`` moving right over a grey background."""
    video = np.full((frames, height, width, 3), 90, dtype=np.uint8)
    for i in range(frames):
        left = (i * width // frames) % width
        video[i, :, left : left + max(2, width // 8)] = colour
    return video


def write_tiny_video_dataset(directory: str | Path) -> Path:
    """``directory/video.jsonl``: 4 samples with videos in every form, and their media.

    0: an .mp4 (16 frames at 8 fps, 64 x 48); 1: an image and an .mp4 (10 frames at 5 fps, 48 x 64);
    2: text only; 3: a folder of 6 PNG frames. ``frames/`` also serves as a frame list.
    """
    from PIL import Image

    directory = Path(directory)
    red, blue, green = (220, 30, 30), (30, 30, 220), (30, 200, 30)
    write_mp4(directory / "videos" / "red.mp4", moving_bar(16, 48, 64, red), 8)
    write_mp4(directory / "videos" / "blue.mp4", moving_bar(10, 64, 48, blue), 5)
    (directory / "frames").mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(moving_bar(6, 56, 56, green)):
        Image.fromarray(frame).save(directory / "frames" / f"{i:03d}.png")
    Image.fromarray(np.full((56, 84, 3), (200, 200, 30), dtype=np.uint8)).save(directory / "yellow.png")

    def turn(question: str, answer: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    lines = [
        {"messages": turn("<video>What colour moves?", "A red bar."), "videos": ["videos/red.mp4"]},
        {
            "messages": turn("<image>This is yellow. <video>And this?", "Blue."),
            "images": ["yellow.png"],
            "videos": ["videos/blue.mp4"],
        },
        {"messages": turn("Say green.", "green")},
        {"messages": turn("<video>Which way?", "Right."), "videos": ["frames"]},
    ]
    target = directory / "video.jsonl"
    target.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return target


#: The pitch classes of :func:`write_tiny_audio_dataset` (name -> frequency band in Hz).
PITCHES = {"low": (150.0, 300.0), "high": (1500.0, 3000.0)}


def write_tiny_audio_dataset(
    directory: str | Path,
    num_samples: int = 8,
    seed: int = 0,
    image_every: int = 3,
    text_only_every: int = 4,
    sampling_rate: int = 16000,
    video_every: int = 0,
) -> Path:
    """``directory/data.jsonl`` plus 16-bit .wav tones: "Which pitch is this?" answered ``low`` or ``high``.

    Each clip is a sine tone (0.3-1.2 s, its frequency drawn within the class's band, a little noise);
    every ``image_every``-th sample adds a PNG before the audio ("<image><audio>"), every
    ``video_every``-th a video of 4 PNG frames instead ("<video><audio>", a frame list; 0: never),
    every ``text_only_every``-th has no media (0: never).
    """
    from PIL import Image

    from mindspeed_mm.data.audio import write_wav

    directory = Path(directory)
    (directory / "audio").mkdir(parents=True, exist_ok=True)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(num_samples):
        name = list(PITCHES)[i % 2]
        if text_only_every and i % text_only_every == text_only_every - 1:
            lines.append(
                {"messages": [{"role": "user", "content": f"Say {name}."}, {"role": "assistant", "content": name}]}
            )
            continue
        low, high = PITCHES[name]
        frequency = float(rng.uniform(low, high))
        t = np.arange(int(sampling_rate * rng.uniform(0.3, 1.2))) / sampling_rate
        wave_ = 0.5 * np.sin(2 * np.pi * frequency * t + rng.uniform(0, 2 * np.pi)) + rng.normal(0, 0.02, t.size)
        audio = directory / "audio" / f"{i:04d}.wav"
        write_wav(str(audio), wave_, sampling_rate)
        record = {
            "messages": [
                {"role": "user", "content": "<audio>Which pitch is this?"},
                {"role": "assistant", "content": name},
            ],
            "audios": [f"audio/{audio.name}"],
        }
        if video_every and i % video_every == video_every - 1:
            frames = []
            for k in range(4):
                path = directory / "images" / f"{i:04d}-frame{k}.png"
                Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(path)
                frames.append(f"images/{path.name}")
            record["messages"][0]["content"] = "<video>" + record["messages"][0]["content"]
            record["videos"] = [frames]
        elif image_every and i % image_every == image_every - 1:
            side = int(rng.choice([28, 56]))
            path = directory / "images" / f"{i:04d}.png"
            Image.fromarray(rng.integers(0, 255, (side, side * 2, 3), dtype=np.uint8)).save(path)
            record["messages"][0]["content"] = "<image>" + record["messages"][0]["content"]
            record["images"] = [f"images/{path.name}"]
        lines.append(record)
    target = directory / "data.jsonl"
    target.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return target
