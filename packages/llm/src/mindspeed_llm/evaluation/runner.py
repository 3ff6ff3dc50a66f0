"""One evaluation run: check every input, load the model once, run the tasks, report.

:func:`evaluate` is what ``mindspeed-llm evaluate`` calls; it can be called from Python with an
:class:`EvaluateConfig`, or :func:`run_tasks` with any :class:`~mindspeed_llm.evaluation.lm.LM`.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger
from mindspeed.metrics.report import TaskResult, build_report, write_json
from mindspeed_llm.evaluation.lm import EngineLM, TransformersLM
from mindspeed_llm.evaluation.tasks import TASKS, EvalSettings
from mindspeed_llm.tokenizer import load_tokenizer

logger = get_logger(__name__)

#: ``--task-data-path demo``: the tiny sample data shipped in ``mindspeed_llm/assets/eval/<task>``.
DEMO_DATA_NAME = "demo"
DEMO_DATA_DIR = Path(__file__).resolve().parent.parent / "assets" / "eval"
BACKENDS = ("engine", "transformers")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass
class EvaluateConfig:
    """Settings of ``mindspeed-llm evaluate`` (one flag per field).

    Attributes:
        load_dir: the model: a Hugging Face directory (either backend) or a Megatron checkpoint (engine backend).
        task: tasks to run (mmlu, gsm8k, ppl; with --harness lm-eval task or group names), in order.
        task_data_path: one data path per task, or one directory holding a folder per task name, or 'demo' for the shipped samples (with --harness: for the mindspeed_* tasks).
        hf_cfg_dir: Hugging Face config directory of a Megatron checkpoint (engine backend).
        tokenizer_name_or_path: tokenizer directory (or 'demo') instead of the model's own.
        backend: 'engine' (the suite's inference engine) or 'transformers' (the reference path).
        shots: few-shot examples: N for every task, or task=N pairs (mmlu=5,gsm8k=8); default mmlu 5, gsm8k 0.
        max_new_tokens: generation budget per GSM8K answer (default 256, at most half the model's window).
        evaluation_batch_size: sequences per model call.
        max_samples: at most this many items per task (per subject for MMLU, documents for ppl).
        max_seq_len: longest sequence fed to the model (default: the model's limit, at most 4096).
        ppl_stride: tokens scored per perplexity window (default: the window length minus one, i.e. chunks).
        dtype: parameter dtype: auto (the checkpoint's), float32, bfloat16 or float16.
        output: JSON report path.
        log_samples: add every item's prediction to the JSON report.
        harness: run the tasks through EleutherAI's lm-evaluation-harness (the eval extra) with the mindspeed model.
        include_path: with --harness: directories of lm-eval task YAML files.
        num_fewshot: with --harness: lm-eval's few-shot count for every task that does not fix it.
        output_dir: with --harness: write results.json (this report) and lm-eval's own lm_eval_results.json there.
        apply_chat_template: with --harness: format prompts with the tokenizer's chat template (lm-eval's flag).
        fewshot_as_multiturn: with --harness and a chat template: few-shot examples as chat turns (lm-eval's flag).
    """

    load_dir: str
    task: list[str]
    task_data_path: list[str] | None = None
    hf_cfg_dir: str | None = None
    tokenizer_name_or_path: str | None = None
    backend: str = "engine"
    shots: str | None = None
    max_new_tokens: int | None = None
    evaluation_batch_size: int = 8
    max_samples: int | None = None
    max_seq_len: int | None = None
    ppl_stride: int | None = None
    dtype: str = "auto"
    output: str | None = None
    log_samples: bool = False
    harness: bool = False
    include_path: list[str] | None = None
    num_fewshot: int | None = None
    output_dir: str | None = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False


def split_list(values: list[str]) -> list[str]:
    """Flatten repeated and comma-separated values: ``["mmlu,gsm8k", "ppl"]`` -> three names."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def parse_shots(text: str | None, tasks: list[str]) -> dict[str, int | None]:
    """``--shots``: ``"5"`` for every task, ``"mmlu=5,gsm8k=8"`` per task; ``None`` leaves the task default.

    Raises:
        ValueError: a value that is not a count, or a task that is not being run.
    """
    shots: dict[str, int | None] = {task: None for task in tasks}
    if text is None:
        return shots
    for part in split_list([text]):
        name, sep, value = part.rpartition("=")
        if not value.strip().isdigit():
            raise ValueError(f"--shots {text!r}: expected a count (5) or task=count pairs (mmlu=5,gsm8k=8)")
        if not sep:
            shots = {task: int(value) for task in tasks}
        elif name.strip() not in shots:
            raise ValueError(
                f"--shots {text!r} names task {name.strip()!r}, which is not in --task ({', '.join(tasks)})"
            )
        else:
            shots[name.strip()] = int(value)
    return shots


def resolve_data_paths(tasks: list[str], paths: list[str]) -> dict[str, Path]:
    """The data path of each task.

    Raises:
        ValueError: a count mismatch, or a shared root without a folder for some task.
    """
    if len(paths) == len(tasks):
        return {t: DEMO_DATA_DIR / t if p == DEMO_DATA_NAME else Path(p) for t, p in zip(tasks, paths)}
    if len(paths) != 1:
        raise ValueError(
            f"--task-data-path: got {len(paths)} paths for {len(tasks)} tasks; pass one per task "
            f"(in --task order) or one directory holding a folder per task"
        )
    root = DEMO_DATA_DIR if paths[0] == DEMO_DATA_NAME else Path(paths[0])
    missing = [t for t in tasks if not (root / t).exists()]
    if missing:
        raise ValueError(
            f"--task-data-path {paths[0]!r} is shared by {len(tasks)} tasks but has no folder for "
            f"{', '.join(missing)}; add {root}/<task>/ or pass one path per task"
        )
    return {t: root / t for t in tasks}


def load_lm(config: EvaluateConfig) -> Any:
    """The model behind ``config.backend``."""
    import torch

    if config.backend not in BACKENDS:
        raise ValueError(f"--backend {config.backend!r} is not one of {', '.join(BACKENDS)}")
    if config.dtype not in DTYPES:
        raise ValueError(f"--dtype {config.dtype!r} is not one of {', '.join(DTYPES)}")
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    tokenizer = load_tokenizer(config.tokenizer_name_or_path) if config.tokenizer_name_or_path else None
    if not Path(config.load_dir).exists():
        raise ValueError(
            f"--load-dir {config.load_dir!r} does not exist; pass a Hugging Face model directory or a Megatron checkpoint"
        )
    if config.backend == "transformers":
        return TransformersLM.from_pretrained(
            config.load_dir, tokenizer, dtype, config.evaluation_batch_size, config.max_seq_len
        )
    extra = {"hf_cfg_dir": config.hf_cfg_dir} if config.hf_cfg_dir else {}
    return EngineLM.from_pretrained(
        config.load_dir, tokenizer, dtype, config.evaluation_batch_size, config.max_seq_len, **extra
    )


def prepare(config: EvaluateConfig) -> tuple[list[str], dict[str, EvalSettings], dict[str, Any]]:
    """Check the flags and load every task's data; nothing touches the model yet.

    Returns:
        The task names, each task's settings and each task's loaded data.

    Raises:
        ValueError: any bad input, naming it and the fix.
    """
    tasks = split_list(config.task)
    if not tasks:
        raise ValueError("--task: name at least one task (" + ", ".join(map(str, TASKS.keys())) + ")")
    for task in tasks:
        TASKS.get(task)  # unknown -> ValueError listing the known tasks
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"--task {','.join(tasks)}: a task is named twice")
    if not config.task_data_path:
        raise ValueError("--task-data-path: pass the data of each task ('demo' for the shipped samples)")
    harness_only = [f for f in ("include_path", "num_fewshot", "output_dir") if getattr(config, f)]
    if harness_only:
        raise ValueError(
            f"--{harness_only[0].replace('_', '-')} applies to --harness runs only; add --harness or drop it"
        )
    paths = resolve_data_paths(tasks, split_list(config.task_data_path))
    shots = parse_shots(config.shots, tasks)
    settings = {
        t: EvalSettings(
            shots=shots[t],
            max_new_tokens=config.max_new_tokens,
            max_samples=config.max_samples,
            ppl_stride=config.ppl_stride,
        )
        for t in tasks
    }
    if config.max_seq_len is not None and config.ppl_stride is not None and config.ppl_stride >= config.max_seq_len:
        raise ValueError(f"--ppl-stride {config.ppl_stride} must be below --max-seq-len {config.max_seq_len}")
    data = {t: TASKS.get(t).load(paths[t], settings[t]) for t in tasks}
    return tasks, settings, data


def run_tasks(lm: Any, tasks: list[str], settings: dict[str, EvalSettings], data: dict[str, Any]) -> list[TaskResult]:
    """Run each task on ``lm``; the result's settings gain the wall time.

    Raises:
        ValueError: a setting the model's window cannot hold (checked for every task before any runs).
    """
    for task in tasks:
        TASKS.get(task).check(lm, settings[task])
    results = []
    for task in tasks:
        start = time.perf_counter()
        result = TASKS.get(task).run(lm, data[task], settings[task])
        result.settings["seconds"] = round(time.perf_counter() - start, 3)
        logger.info(
            "%s: %s = %.4f over %d in %.1f s", task, result.metric, result.value, result.n, result.settings["seconds"]
        )
        results.append(result)
    return results


def evaluate(config: EvaluateConfig) -> tuple[list[TaskResult], dict[str, Any]]:
    """Run ``config``: check inputs and data, load the model, run the tasks, write the JSON report.

    Returns:
        The results and the JSON report (also written to ``config.output`` when set).

    Raises:
        ValueError: bad input (before the model is loaded when it is in the flags or the data).
    """
    tasks, settings, data = prepare(config)
    lm = load_lm(config)
    results = run_tasks(lm, tasks, settings, data)
    run_settings = {**dataclasses.asdict(config), "task": tasks, "max_seq_len": lm.max_seq_len}
    report = build_report(results, run_settings, config.log_samples)
    if config.output:
        write_json(config.output, report)
        logger.info("wrote %s", config.output)
    return results, report
