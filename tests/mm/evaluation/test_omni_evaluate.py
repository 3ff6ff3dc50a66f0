"""``mindspeed-mm evaluate`` on Qwen2.5-Omni audio questions agrees with transformers on inputs built here.

A multiple-choice question on a clip (``audio`` + ``options``) is scored by the options' log-likelihoods,
which equal the thinker's own forward on ``Qwen2_5OmniProcessor``'s inputs; an mllm_format sample with
``audios`` is a short-answer question whose reply equals the thinker's greedy ``generate``.
"""

from __future__ import annotations

import json

import pytest
import torch

from mindspeed_mm.cli import main
from mindspeed_mm.data.audio import decode_audio
from mindspeed_mm.evaluation.scoring import LETTER_INSTRUCTION
from mindspeed_mm.testing import write_tiny_audio_dataset, write_tiny_model


def test_omni_audio_questions_equal_transformers(tmp_path) -> None:
    from transformers import (
        AutoTokenizer,
        Qwen2_5OmniProcessor,
        Qwen2_5OmniThinkerForConditionalGeneration,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from mindspeed_mm.models.qwen2_5_omni import TOKEN_ATTRIBUTES

    model_dir = write_tiny_model(tmp_path / "omni", "Qwen2_5OmniThinkerForConditionalGeneration")
    data = write_tiny_audio_dataset(tmp_path / "data", num_samples=2, image_every=0)
    root = data.parent
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for name, token in TOKEN_ATTRIBUTES.items():
        setattr(tokenizer, name, token)
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
        video_processor=Qwen2VLVideoProcessor.from_pretrained(model_dir),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir / "audio_processor"),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

    def inputs(user: str, clip: str, answer: str | None = None) -> dict:
        turns = [{"role": "user", "content": user.replace("<audio>", "<|audio_bos|><|AUDIO|><|audio_eos|>")}]
        if answer is None:
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        else:
            text = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": answer}], tokenize=False)
        return processor(text=[text], audio=[decode_audio(clip, 16000, "ref")], return_tensors="pt")

    def loglikelihood(user: str, clip: str, answer: str) -> float:
        prompt = inputs(user, clip)["input_ids"].shape[1]
        whole = inputs(user, clip, answer)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(**whole).logits[0].float(), dim=-1)
        ids = whole["input_ids"][0]
        return float(sum(logprobs[i - 1, ids[i]] for i in range(prompt, ids.numel())))

    clip = str(root / "audio" / "0000.wav")
    user = f"<audio>Which pitch is this?\nA. low\nB. high\n{LETTER_INSTRUCTION}"
    scores = {letter: loglikelihood(user, clip, letter) for letter in "AB"}
    best = max(scores, key=scores.get)
    question = {"audio": "audio/0000.wav", "question": "Which pitch is this?", "options": ["low", "high"]}
    question["answer"] = best
    sample = json.loads(data.read_text().splitlines()[1])  # an mllm_format sample: "<audio>Which pitch is this?"
    prompt = inputs(sample["messages"][0]["content"], str(root / sample["audios"][0]))
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    questions = tmp_path / "audio_vqa.jsonl"
    questions.write_text(json.dumps(question) + "\n" + json.dumps(sample) + "\n")
    result_file = tmp_path / "results.json"
    argv = ["evaluate", "--load-dir", str(model_dir), "--task-data-path", str(questions)]
    argv += ["--output", str(result_file), "--image-dir", str(root), "--log-samples", "--max-new-tokens", "8"]
    assert main(argv) == 0
    (result,) = json.loads(result_file.read_text())["results"]
    choice, short = result["samples"]
    assert choice["loglikelihoods"] == pytest.approx(scores, rel=1e-5, abs=1e-4)
    assert choice["prediction"] == best and choice["correct"]
    assert short["reply"] == reply
    print(f"Omni evaluate: log-likelihoods {scores}, reply {reply!r}, metrics {result['metrics']}")
