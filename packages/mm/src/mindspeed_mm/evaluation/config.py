"""The options of ``mindspeed-mm evaluate`` (a module without torch, so the CLI starts fast)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

CHOICE_SCORING = ("likelihood", "generate")
CHOICE_PROMPTS = ("letter", "cloze")


@dataclass(kw_only=True)
class EvaluateConfig:
    """Every ``evaluate`` option (the CLI flags are these names with dashes).

    Attributes:
        load_dir: the model: a Hugging Face directory, a mindspeed-mm training checkpoint (checkpoint.save
            or one of its step_* folders; needs --base-dir), a PEFT LoRA adapter (merged into its base), or
            demo (the demo's untrained model).
        task_data_path: data files: MMBench-style .tsv (base64 images), .json / .jsonl (image paths), or demo
            (an MMBench TSV of the demo's held-out questions); repeatable.
        base_dir: the Hugging Face directory a training checkpoint was trained from; demo for the demo model.
        choice_scoring: multiple choice by the likelihood of each option's answer, or by greedy generation and
            answer extraction.
        choice_prompt: letter: the options are listed and the answer is their letter (MMBench); cloze: the
            question alone, the answer is the option's text.
        max_new_tokens: generation budget of short answers and of --choice-scoring generate.
        evaluation_batch_size: generated replies decoded together (left-padded; greedy replies do not
            depend on it).
        max_samples: the first N questions of each file only.
        image_dir: folder the image and video paths of .json / .jsonl files are relative to (default: the
            file's folder).
        image_min_pixels: images are resized to at least this many pixels.
        image_max_pixels: and to at most this many (use the values the model was trained with).
        video_fps: video frames sampled per second (data.video_fps of the training recipe).
        video_maxlen: at most this many frames per video (data.video_maxlen).
        video_max_pixels: video frames are resized to at most this many pixels (data.video_max_pixels).
        video_min_pixels: and to at least this many (data.video_min_pixels).
        dtype: float32, bfloat16 or float16 (default: the directory's; float32 for a training checkpoint).
        lora_alpha: the recipe's lora.alpha, to merge a LoRA run's training checkpoint moved away from
            its save folder (default: the alpha the run recorded there).
        output: write the results as JSON here (written under a temporary name, then renamed).
        log_samples: add every question (prompt, prediction, answer, correct, log-likelihoods or reply) to the JSON.
    """

    load_dir: str
    task_data_path: list[str] = field(default_factory=list)
    base_dir: str | None = None
    choice_scoring: str = "likelihood"
    choice_prompt: str = "letter"
    max_new_tokens: int = 16
    evaluation_batch_size: int = 8
    max_samples: int | None = None
    image_dir: str | None = None
    image_min_pixels: int = 3136
    image_max_pixels: int = 262144
    video_fps: float = 2.0
    video_maxlen: int = 128
    video_max_pixels: int = 65536
    video_min_pixels: int = 256
    dtype: str | None = None
    lora_alpha: float | None = None
    output: str | None = None
    log_samples: bool = False

    def check(self) -> None:
        """Raises ValueError naming the flag of a bad value."""
        if not self.task_data_path:
            raise ValueError("--task-data-path is missing: give an MMBench-style .tsv, a .json / .jsonl file, or demo")
        if self.choice_scoring not in CHOICE_SCORING:
            raise ValueError(f"--choice-scoring {self.choice_scoring!r} is not one of {', '.join(CHOICE_SCORING)}")
        if self.choice_prompt not in CHOICE_PROMPTS:
            raise ValueError(f"--choice-prompt {self.choice_prompt!r} is not one of {', '.join(CHOICE_PROMPTS)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if self.evaluation_batch_size < 1:
            raise ValueError(f"--evaluation-batch-size {self.evaluation_batch_size} must be at least 1")
        if self.video_fps <= 0 or self.video_maxlen < 1:
            raise ValueError(
                f"--video-fps {self.video_fps} and --video-maxlen {self.video_maxlen} must be positive; use the "
                "training recipe's data.video_fps and data.video_maxlen"
            )
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"--max-samples {self.max_samples} must be at least 1")
        if self.output is not None and Path(self.output).is_dir():
            raise ValueError(f"--output {self.output} is a directory; give a file name")
