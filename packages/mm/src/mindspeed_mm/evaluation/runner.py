"""``evaluate``: VQA accuracy of a model on local files, one result per file (the LLM suite's report format).

Every file is read and checked before the model is loaded. Multiple-choice items are scored by
answer likelihood (default) or by generation; short-answer items by the normalized exact match
of a greedy reply (:mod:`mindspeed_mm.evaluation.scoring`). The result of a file is a
:class:`mindspeed.metrics.report.TaskResult`: ``acc`` over its items (``exact_match``
when it holds only short-answer items), ``acc_multiple_choice`` / ``exact_match`` when it holds
both, and per-category accuracy in ``groups``.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger
from mindspeed.metrics.report import TaskResult, build_report, write_json
from mindspeed.progress import StatusProgress
from mindspeed_mm.data.video import VideoSettings
from mindspeed_mm.evaluation.config import EvaluateConfig
from mindspeed_mm.evaluation.data import VQAItem, read_vqa_file
from mindspeed_mm.evaluation.scoring import (
    extract_choice,
    item_prompt,
    score_choice_by_likelihood,
    short_answer_correct,
)
from mindspeed_mm.inference import SamplingSettings, encode_prompt, load_inference_model
from mindspeed_mm.inference.generation import generate_batch
from mindspeed_mm.inference.loading import InferenceModel

logger = get_logger(__name__)


def evaluate(config: EvaluateConfig) -> tuple[list[TaskResult], dict[str, Any]]:
    """Score the model on every file; returns the results and the JSON report (written to ``output`` if set)."""
    config.check()
    with tempfile.TemporaryDirectory(prefix="mindspeed-mm-eval-") as images:
        data = []
        for name in config.task_data_path:
            path = Path(name)  # the demo's name is resolved by the caller (mindspeed_mm.demos.names)
            task = path.stem
            data.append(
                (task, path, read_vqa_file(path, Path(images) / str(len(data)), config.image_dir, config.max_samples))
            )
        loaded = load_inference_model(
            config.load_dir,
            config.base_dir,
            config.dtype,
            config.image_min_pixels,
            config.image_max_pixels,
            config.lora_alpha,
            VideoSettings(config.video_fps, config.video_maxlen, config.video_max_pixels, config.video_min_pixels),
        )
        results = [score_file(loaded, task, path, items, config) for task, path, items in data]
    report = build_report(results, asdict(config), with_samples=config.log_samples)
    if config.output:
        write_json(config.output, report)
    return results, report


def generated(item: VQAItem, config: EvaluateConfig) -> bool:
    """Whether ``item`` is answered by generation (short answers; multiple choice under ``generate`` scoring)."""
    return not item.multiple_choice or config.choice_scoring == "generate"


def score_item(
    loaded: InferenceModel, item: VQAItem, config: EvaluateConfig, reply: str | None = None
) -> dict[str, Any]:
    """One question's record: ``index``, ``category``, ``prediction``, ``answer``, ``correct`` (and how it was read).

    ``reply``: the greedy reply of a generated item (generated here when not given).
    """
    record: dict[str, Any] = {"index": item.index, "category": item.category}
    if not generated(item, config):
        record.update(score_choice_by_likelihood(loaded, item, config.choice_prompt))
    else:
        record["reply"] = reply if reply is not None else generate_replies(loaded, [item], config)[0]
        record["prediction"] = (
            extract_choice(record["reply"], item.options) if item.multiple_choice else record["reply"]
        )
    if item.multiple_choice:
        record.update(answer=item.answers[0], correct=record["prediction"] == item.answers[0], kind="multiple_choice")
    else:
        record.update(
            answer=list(item.answers),
            correct=short_answer_correct(record["prediction"], item.answers),
            kind="short_answer",
        )
    return record


def generate_replies(loaded: InferenceModel, items: list[VQAItem], config: EvaluateConfig) -> list[str]:
    """Greedy replies of ``items``, decoded together (left-padded; each the reply it gets alone)."""
    settings = SamplingSettings(max_new_tokens=config.max_new_tokens)
    encoded = [encode_prompt(item_prompt(item, config.choice_prompt), loaded) for item in items]
    return [
        loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        for tokens in generate_batch(loaded, encoded, settings)
    ]


def score_file(
    loaded: InferenceModel, task: str, path: Path, items: list[VQAItem], config: EvaluateConfig
) -> TaskResult:
    """The :class:`TaskResult` of one file (generated items in batches of ``evaluation_batch_size``)."""
    started = time.perf_counter()
    samples = []
    with StatusProgress(f"evaluate {task}", total=len(items)) as bar:
        for start in range(0, len(items), config.evaluation_batch_size):
            chunk = items[start : start + config.evaluation_batch_size]
            asked = [item for item in chunk if generated(item, config)]
            replies = dict(zip(map(id, asked), generate_replies(loaded, asked, config))) if asked else {}
            for item in chunk:
                samples.append(score_item(loaded, item, config, replies.get(id(item))))
                right = sum(s["correct"] for s in samples)
                bar.update(status=f"acc {right / len(samples):.3f}")
    metrics = {"acc": _mean(samples)}
    kinds = {s["kind"] for s in samples}
    if kinds == {"short_answer"}:
        metrics = {"exact_match": metrics["acc"]}
    elif len(kinds) == 2:
        metrics["acc_multiple_choice"] = _mean([s for s in samples if s["kind"] == "multiple_choice"])
        metrics["exact_match"] = _mean([s for s in samples if s["kind"] == "short_answer"])
    headline = next(iter(metrics))
    groups = {}
    for category in sorted({s["category"] for s in samples if s["category"]}):
        members = [s for s in samples if s["category"] == category]
        groups[category] = {headline: _mean(members), "n": len(members)}
    settings = {
        "data": str(path),
        "choice_scoring": config.choice_scoring,
        "choice_prompt": config.choice_prompt,
        "max_new_tokens": config.max_new_tokens,
        "seconds": round(time.perf_counter() - started, 3),
    }
    logger.info("%s: %s %.4f over %d questions", task, headline, metrics[headline], len(samples))
    return TaskResult(
        task=task,
        metric=headline,
        value=metrics[headline],
        n=len(samples),
        metrics=metrics,
        groups=groups,
        samples=samples,
        settings=settings,
    )


def _mean(samples: list[dict[str, Any]]) -> float:
    return sum(bool(s["correct"]) for s in samples) / max(len(samples), 1)
