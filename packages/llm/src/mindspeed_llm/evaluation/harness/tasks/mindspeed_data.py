"""Data loaders and the GSM8K grader of the ``mindspeed_*`` lm-eval tasks (our built-in tasks as lm-eval YAML).

lm-eval calls each loader as the task's ``custom_dataset`` with the run's metadata as keyword
arguments. Three metadata keys are ours: ``mindspeed_data`` (task -> data path, as
``--task-data-path``; default the shipped demo data), ``mindspeed_shots`` (task -> few-shot
count, as ``--shots``) and ``mindspeed_max_samples`` (as ``--max-samples``). The records are read
and checked by the built-in tasks' own loaders and prompts are built by their own functions, so
both paths feed the model the same text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from mindspeed.evaluation.math_answer import answers_equal, extract_answer
from mindspeed_llm.evaluation import gsm8k, mmlu
from mindspeed_llm.evaluation.perplexity import PerplexityTask
from mindspeed_llm.evaluation.runner import DEMO_DATA_DIR, DEMO_DATA_NAME
from mindspeed_llm.evaluation.tasks import EvalSettings


def _settings(task: str, metadata: dict[str, Any]) -> tuple[Path, EvalSettings]:
    path = (metadata.get("mindspeed_data") or {}).get(task, DEMO_DATA_NAME)
    shots = (metadata.get("mindspeed_shots") or {}).get(task)
    settings = EvalSettings(shots=shots, max_samples=metadata.get("mindspeed_max_samples"), show_progress=False)
    return DEMO_DATA_DIR / task if path == DEMO_DATA_NAME else Path(path), settings


def _split(rows: list[dict[str, Any]]) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mmlu(**metadata: Any) -> datasets.DatasetDict:
    """One record per MMLU test question: its few-shot ``prompt``, ``subject`` and ``answer`` index."""
    path, settings = _settings("mmlu", metadata)
    data = mmlu.MMLUTask().load(path, settings)
    rows = []
    for subject, (dev, questions) in data.subjects.items():
        for index, question in enumerate(questions):
            prompt = mmlu.build_prompt(subject, dev, question, data.shots)
            rows.append(
                {"subject": subject, "index": index, "prompt": prompt, "answer": mmlu.LETTERS.index(question.answer)}
            )
    return _split(rows)


def load_gsm8k(**metadata: Any) -> datasets.DatasetDict:
    """One record per GSM8K test problem: its few-shot ``prompt`` and the ``reference`` answer."""
    path, settings = _settings("gsm8k", metadata)
    data = gsm8k.GSM8KTask().load(path, settings)
    rows = [
        {"index": i, "prompt": gsm8k.build_prompt(data.examples, p), "reference": p.reference}
        for i, p in enumerate(data.problems)
    ]
    return _split(rows)


def load_ppl(**metadata: Any) -> datasets.DatasetDict:
    """One record per perplexity document (its ``text``)."""
    path, settings = _settings("ppl", metadata)
    data = PerplexityTask().load(path, settings)
    return _split([{"index": i, "text": text} for i, text in enumerate(data.documents)])


def score_gsm8k(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Exact match of the generation's answer with the reference, by the suite's one math grader."""
    prediction = extract_answer(results[0])
    return {"exact_match": float(prediction is not None and answers_equal(prediction, doc["reference"]))}
