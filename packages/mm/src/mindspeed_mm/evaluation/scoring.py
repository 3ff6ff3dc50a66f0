"""How a VQA item is asked and scored.

**Prompts** (the user turn, through the model's chat template as in training; ``<image>`` first,
then ``<video>``, unless the question places them):

- ``letter`` (MMBench's protocol, as LLaVA and lmms-eval ask it)::

      <image>{hint}\\n{question}\\nA. {A}\\nB. {B}\\n...\\nAnswer with the option's letter from the given choices directly.

  the hint line only when there is one; the answer is the letter.
- ``cloze``: ``<image>{hint}\\n{question}``; the answer is the option's text (for models trained to
  answer in words, such as the demo).
- short answer: ``<image>{question}``.

**Multiple choice by likelihood**: each option's answer (letter or text) is put as the assistant
turn and scored by the sum of the log-probabilities of its tokens, the chat template's end of
turn included (what the trainer labels); the highest wins, the first on a tie.

**By generation** (multiple choice with ``--choice-scoring generate``, and every short answer): the
greedy reply is read by :func:`extract_choice` / compared by :func:`normalize_answer`.
"""

from __future__ import annotations

import re
import string
from typing import Any

import torch

from mindspeed_mm.data.encode import IGNORE_INDEX
from mindspeed_mm.data.mllm import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from mindspeed_mm.evaluation.data import VQAItem
from mindspeed_mm.inference.generation import model_inputs
from mindspeed_mm.inference.loading import InferenceModel
from mindspeed_mm.inference.prompts import Prompt, encode_with_answer

#: The MMBench instruction after the options (LLaVA-1.5 / lmms-eval).
LETTER_INSTRUCTION = "Answer with the option's letter from the given choices directly."
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def question_text(item: VQAItem, style: str) -> str:
    """The user turn of ``item`` under ``style`` (``letter`` or ``cloze``; short answers ignore it)."""
    text = f"{item.hint}\n{item.question}" if item.hint else item.question
    if item.multiple_choice and style == "letter":
        text += "".join(f"\n{letter}. {option}" for letter, option in item.options.items())
        text += "\n" + LETTER_INSTRUCTION
    prefix = "" if IMAGE_PLACEHOLDER in text else IMAGE_PLACEHOLDER * len(item.images)
    prefix += "" if VIDEO_PLACEHOLDER in text else VIDEO_PLACEHOLDER * len(item.videos)
    prefix += "" if AUDIO_PLACEHOLDER in text else AUDIO_PLACEHOLDER * len(item.audios)
    return prefix + text


def item_prompt(item: VQAItem, style: str) -> Prompt:
    """The conversation that asks ``item``."""
    return Prompt(
        messages=({"role": "user", "content": question_text(item, style)},),
        images=item.images,
        source=item.source,
        videos=item.videos,
        audios=item.audios,
    )


def choice_continuations(item: VQAItem, style: str) -> dict[str, str]:
    """Letter -> the assistant answer scored for it (the letter, or the option's text for ``cloze``)."""
    return {letter: (letter if style == "letter" else option) for letter, option in item.options.items()}


def answer_logprob(loaded: InferenceModel, prompt: Prompt, answer: str) -> float:
    """Sum of log p(answer token | everything before) over the answer's tokens (end of turn included)."""
    _, whole = encode_with_answer(prompt, answer, loaded)
    with torch.no_grad():
        logits = loaded.model(**model_inputs(whole, loaded), use_cache=False).logits[0, :-1].float()
    targets = whole.labels[1:].to(logits.device)
    mask = targets != IGNORE_INDEX
    logprobs = torch.log_softmax(logits[mask], dim=-1).gather(1, targets[mask][:, None])
    return float(logprobs.sum())


def normalize_answer(text: str) -> str:
    """Lower case, punctuation removed, articles (a, an, the) removed, whitespace collapsed (SQuAD's normalization)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def extract_choice(reply: str, options: dict[str, str]) -> str | None:
    """The option letter a free-form reply chose (None: none can be read), by the first rule that applies.

    1. The normalized reply equals one option's normalized text (``Red.`` for ``red``).
    2. The reply is an option letter (``B``, ``(B)``, ``b.``), or starts with a capital one and a
       separator (``B. cat``, ``B: cat``, ``B) cat``).
    3. Exactly one option's normalized text occurs as words in the normalized reply
       (``It is a red square`` for ``red``).
    4. Exactly one option letter occurs as a word of the reply (``The answer is B``).
    """
    said = normalize_answer(reply)
    texts = {letter: normalize_answer(option) for letter, option in options.items()}
    exact = [letter for letter, text in texts.items() if text and text == said]
    if len(exact) == 1:
        return exact[0]
    bare = reply.strip(string.punctuation + string.whitespace)
    if len(bare) == 1 and bare.upper() in options:
        return bare.upper()
    lead = re.match(r"^\(?([A-Z])(?:\)|\.|:|\]|$)", reply.strip())
    if lead and lead.group(1) in options:
        return lead.group(1)
    found = [letter for letter, text in texts.items() if text and re.search(rf"\b{re.escape(text)}\b", said)]
    if len(found) == 1:
        return found[0]
    named = {word for word in re.findall(r"\b([A-Z])\b", reply) if word in options}
    return named.pop() if len(named) == 1 else None


def short_answer_correct(reply: str, answers: tuple[str, ...]) -> bool:
    """Normalized exact match against any accepted answer."""
    said = normalize_answer(reply)
    return any(said == normalize_answer(answer) for answer in answers)


def score_choice_by_likelihood(loaded: InferenceModel, item: VQAItem, style: str) -> dict[str, Any]:
    """``{"loglikelihoods", "prediction"}`` of a multiple-choice item."""
    prompt = item_prompt(item, style)
    scores = {
        letter: answer_logprob(loaded, prompt, text) for letter, text in choice_continuations(item, style).items()
    }
    best = max(scores.values())
    return {"loglikelihoods": scores, "prediction": next(k for k, v in scores.items() if v == best)}
