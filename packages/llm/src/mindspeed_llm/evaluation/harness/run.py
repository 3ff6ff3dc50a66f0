"""``mindspeed-llm evaluate --harness``: lm-eval's ``simple_evaluate`` with the ``mindspeed`` model.

Tasks are lm-eval task or group names, found first in the shipped ``mindspeed_*`` tasks
(:data:`HARNESS_TASKS_DIR`) and the ``--include-path`` directories, then (only if some name is
not there, as indexing them takes seconds) among lm-eval's own tasks. Nothing is downloaded: a
standard task needs its ``dataset_path`` pointed at a local copy (docs/llm/evaluate.md). The
results become :class:`~mindspeed.metrics.report.TaskResult` rows, printed and written like the
built-in tasks'; ``--output-dir`` also keeps lm-eval's own results document.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger
from mindspeed.metrics.report import TaskResult, build_report, write_json
from mindspeed_llm.evaluation.harness import import_lm_eval
from mindspeed_llm.evaluation.harness.model import MODEL_NAME, register_harness_model
from mindspeed_llm.evaluation.runner import EvaluateConfig, parse_shots, resolve_data_paths, split_list

import_lm_eval()  # before any lm_eval import: keeps the environment unchanged (see there)

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

logger = get_logger(__name__)

#: The shipped task YAMLs: our built-in tasks as lm-eval tasks (``mindspeed_mmlu``, ``mindspeed_gsm8k``, ``mindspeed_ppl``).
HARNESS_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
#: lm-eval task name -> built-in task name, for ``--task-data-path``, ``--shots`` and ``--max-samples``.
BUILTIN_TASKS = {"mindspeed_mmlu": "mmlu", "mindspeed_gsm8k": "gsm8k", "mindspeed_ppl": "ppl"}


def task_metadata(config: EvaluateConfig, tasks: list[str]) -> dict[str, Any]:
    """lm-eval metadata that points the ``mindspeed_*`` tasks at ``--task-data-path`` with ``--shots``.

    Raises:
        ValueError: data paths or shots that do not fit the built-in tasks being run.
    """
    builtin = [BUILTIN_TASKS[t] for t in tasks if t in BUILTIN_TASKS]
    metadata: dict[str, Any] = {}
    if config.task_data_path:
        if not builtin:
            raise ValueError(
                "--task-data-path applies to the mindspeed_* tasks only; point other lm-eval tasks at local data in their YAML"
            )
        metadata["mindspeed_data"] = {
            t: str(p) for t, p in resolve_data_paths(builtin, split_list(config.task_data_path)).items()
        }
    if config.shots is not None:
        metadata["mindspeed_shots"] = parse_shots(config.shots, builtin)
    return metadata


def build_task_manager(include_paths: list[str], tasks: list[str], metadata: dict[str, Any]) -> TaskManager:
    """An lm-eval ``TaskManager`` that knows every name in ``tasks``.

    Raises:
        ValueError: an include path that is not a directory, or a task lm-eval does not know.
    """
    for path in include_paths:
        if not Path(path).is_dir():
            raise ValueError(f"--include-path {path!r} is not a directory; pass a folder of lm-eval task YAML files")
    paths = [str(HARNESS_TASKS_DIR), *include_paths]
    manager = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=paths, include_defaults=True, metadata=metadata)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise ValueError(
            f"--task {', '.join(missing)}: not an lm-eval task or group here; 'lm-eval ls tasks' lists them, "
            f"or pass --include-path DIR holding its YAML"
        )
    return manager


def to_task_results(output: dict[str, Any], with_samples: bool) -> list[TaskResult]:
    """One :class:`TaskResult` per task or group of lm-eval's results (filter ``none`` drops its suffix)."""
    results = []
    for task, values in output["results"].items():
        metrics = {}
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if key in ("alias", "sample_len") or "_stderr" in name or not isinstance(value, (int, float)):
                continue
            metrics[name if filt in ("", "none") else f"{name},{filt}"] = float(value)
        if not metrics:
            continue
        order = list(output.get("higher_is_better", {}).get(task, {})) or list(metrics)
        headline = next((m for m in order if m in metrics), next(iter(metrics)))
        counts = output.get("n-samples", {}).get(task, {})
        samples = []
        if with_samples:
            samples = [
                {"doc_id": s["doc_id"], "target": str(s.get("target")), "resps": s.get("filtered_resps")}
                | {m: s[m] for m in metrics if m in s}
                for s in output.get("samples", {}).get(task, [])
            ]
        shots = output.get("n-shot", {}).get(task)
        results.append(
            TaskResult(
                task=task,
                metric=headline,
                value=metrics[headline],
                n=int(counts.get("effective", len(samples))),
                metrics=metrics,
                samples=samples,
                settings={"harness": True, "num_fewshot": shots},
            )
        )
    return results


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _simple_evaluate(
    config: EvaluateConfig, model_args: dict[str, Any], tasks: list[str], manager: TaskManager
) -> dict[str, Any]:
    return simple_evaluate(
        model=MODEL_NAME,
        model_args={k: v for k, v in model_args.items() if v is not None},
        tasks=tasks,
        num_fewshot=config.num_fewshot,
        limit=config.max_samples,
        task_manager=manager,
        log_samples=True,
        apply_chat_template=config.apply_chat_template,
        fewshot_as_multiturn=config.fewshot_as_multiturn,
        gen_kwargs={"max_gen_toks": config.max_new_tokens} if config.max_new_tokens else None,
    )


def evaluate_harness(config: EvaluateConfig) -> tuple[list[TaskResult], dict[str, Any], dict[str, Any]]:
    """Run ``config.task`` through lm-eval with the ``mindspeed`` model.

    Returns:
        Our results, our JSON report, and lm-eval's own results document (``samples`` included).

    Raises:
        ValueError: bad flags or unknown tasks (before the model is loaded).
    """
    tasks = split_list(config.task)
    if not tasks:
        raise ValueError("--task: name at least one lm-eval task (mindspeed_mmlu, mindspeed_gsm8k, mindspeed_ppl, ...)")
    if not Path(config.load_dir).exists():
        raise ValueError(
            f"--load-dir {config.load_dir!r} does not exist; pass a Hugging Face model directory or a Megatron checkpoint"
        )
    metadata = task_metadata(config, tasks)
    manager = build_task_manager(split_list(config.include_path or []), tasks, metadata)
    register_harness_model()
    model_args = {
        "pretrained": config.load_dir,
        "batch_size": config.evaluation_batch_size,
        "max_length": config.max_seq_len,
        "dtype": config.dtype,
        "tokenizer": config.tokenizer_name_or_path,
        "hf_cfg_dir": config.hf_cfg_dir,
    }
    start = time.perf_counter()
    try:
        output = _simple_evaluate(config, model_args, tasks, manager)
    except ConnectionError as err:  # datasets asked the Hub for a task's data: this suite runs offline
        raise ValueError(
            f"--task {','.join(tasks)}: {err}; point the task's dataset_path at a local copy of its data "
            f"(docs/llm/evaluate.md, 'Tasks from local files')"
        ) from err
    seconds = round(time.perf_counter() - start, 3)

    results = to_task_results(output, config.log_samples)
    for result in results:
        result.settings["seconds"] = seconds
        logger.info("%s: %s = %.4f over %d", result.task, result.metric, result.value, result.n)
    report = build_report(results, {**dataclasses.asdict(config), "task": tasks}, config.log_samples)
    if config.output:
        write_json(config.output, report)
    if config.output_dir:
        out = Path(config.output_dir)
        write_json(out / "results.json", report)
        lm_eval_doc = _json_safe({k: v for k, v in output.items() if k != "samples"})
        write_json(out / "lm_eval_results.json", lm_eval_doc)
        if config.log_samples:
            write_json(out / "lm_eval_samples.json", _json_safe(output.get("samples", {})))
        logger.info("wrote %s", out)
    return results, report, output
