"""The audio demo: a tiny Qwen2.5-Omni thinker learns to tell a low tone from a high one on a CPU.

Clips are sine tones (0.3-1.2 s at 16 kHz, 150-300 Hz "low" or 1.5-3 kHz "high", a little
noise; :func:`~mindspeed_mm.testing.fixtures.write_tiny_audio_dataset`), asked "Which pitch is
this?". :func:`pitch_accuracy` scores a model on held-out clips by which answer's first token
(``l`` or ``h``) the model finds likelier after the prompt (chance: 1/2).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mindspeed_mm.data.encode import IGNORE_INDEX


def pitch_accuracy(model_dir: str | Path, data_file: str | Path) -> float:
    """The share of ``data_file``'s samples whose answer (``low`` / ``high``) the model of ``model_dir`` prefers."""
    from mindspeed_mm.data import read_mllm_files
    from mindspeed_mm.data.preprocess import EncodeSettings, Processing
    from mindspeed_mm.models import family_of, load_audio_processor, load_model, load_processing

    family = family_of(model_dir)
    tokenizer, processor = load_processing(model_dir, 28 * 28, 112 * 112)
    processing = Processing(tokenizer, processor, family, None, load_audio_processor(model_dir))
    model = load_model(model_dir, family, "sdpa").eval()
    first = {answer: tokenizer(answer, add_special_tokens=False)["input_ids"][0] for answer in ("low", "high")}
    right = total = 0
    for sample in read_mllm_files([str(data_file)]):
        encoded = processing.encode(sample, EncodeSettings(cutoff_len=1024))
        start = int((encoded.labels != IGNORE_INDEX).nonzero()[0])
        ids = encoded.input_ids[None, :start]
        vision = encoded.vision
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **vision).logits[0, -1]
        guess = max(first, key=lambda answer: float(logits[first[answer]]))
        right += guess == sample.messages[-1]["content"]
        total += 1
    return right / total
