"""Evaluation of language models on local data in the public formats.

Tasks (registered in :data:`TASKS`, run with ``mindspeed-llm evaluate --task NAME``):

- ``mmlu``: multiple choice, 5-shot by default, scored by the log-likelihood of each answer letter.
- ``gsm8k``: greedy generation, the final number compared with the reference.
- ``ppl``: token-level perplexity over windows of at most ``--max-seq-len`` tokens.

Tasks talk to a model through the :class:`LM` protocol; :class:`EngineLM` (the suite's inference
engine) and :class:`TransformersLM` (plain ``transformers``, the reference) implement it.

:mod:`mindspeed_llm.evaluation.harness` (the ``eval`` extra) makes the engine an lm-evaluation-harness
model and runs lm-eval tasks (``--harness``); it is not imported here.
"""

from __future__ import annotations

from mindspeed.metrics.report import TaskResult
from mindspeed_llm.evaluation import gsm8k, mmlu, perplexity  # noqa: F401  (register the tasks)
from mindspeed_llm.evaluation.lm import LM, EngineLM, TransformersLM
from mindspeed_llm.evaluation.runner import EvaluateConfig, evaluate, run_tasks
from mindspeed_llm.evaluation.tasks import TASKS, EvalSettings

__all__ = [
    "LM",
    "EngineLM",
    "TransformersLM",
    "EvaluateConfig",
    "evaluate",
    "run_tasks",
    "TASKS",
    "EvalSettings",
    "TaskResult",
]
