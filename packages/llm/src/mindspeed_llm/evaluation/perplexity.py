"""Perplexity of a model on local text: token-level, over windows no longer than the model's.

Data: a ``.txt`` or ``.raw`` file (the whole file is one document, as WikiText's
``wiki.test.raw``), a ``.jsonl`` file (one document per line, in its ``text`` field), or a
directory of such files (read in name order).

Each document is tokenized with the tokenizer's special prefix (BOS where the tokenizer adds
one). Every token after the first is scored exactly once. Tokens are scored in blocks of
``stride``; each block is fed to the model with as many of the tokens before it as fit in
``max_seq_len`` (a sliding window when ``stride`` is small, chunks when it is
``max_seq_len - 1``, the default). Perplexity is ``exp(total NLL / scored tokens)``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from mindspeed.metrics.report import TaskResult
from mindspeed_llm.evaluation.lm import encode_context
from mindspeed_llm.evaluation.tasks import TASKS, EvalSettings, call_in_chunks, iter_jsonl, limit, require_path

_TEXT_SUFFIXES = (".txt", ".raw")
_SUFFIXES = (*_TEXT_SUFFIXES, ".jsonl")


@dataclasses.dataclass
class TextData:
    """Loaded documents.

    Attributes:
        path: the file or directory given.
        documents: the texts.
    """

    path: Path
    documents: list[str]


def read_documents(path: Path) -> list[str]:
    """The documents of one ``.txt``/``.raw`` or ``.jsonl`` file.

    Raises:
        ValueError: another suffix, or a JSON line without a string ``text``, naming file and line.
    """
    if path.suffix in _TEXT_SUFFIXES:
        text = path.read_text(encoding="utf-8")
        return [text] if text.strip() else []
    if path.suffix != ".jsonl":
        raise ValueError(
            f"{path}: perplexity reads .txt/.raw files (one document each) or .jsonl files with a 'text' field"
        )
    documents = []
    for number, record in iter_jsonl(path):
        if not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{number}: expected a string field 'text', got keys {sorted(record)}")
        documents.append(record["text"])
    return documents


def windows(num_tokens: int, max_seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """``(start, begin, end)`` per window: feed tokens ``[start, end)`` and score ``[begin, end)``.

    Every token but the first is scored once; no window is longer than ``max_seq_len``.

    Raises:
        ValueError: ``stride`` not in ``[1, max_seq_len - 1]``.
    """
    if not 1 <= stride <= max_seq_len - 1:
        raise ValueError(f"--ppl-stride {stride} must be between 1 and the window length minus one ({max_seq_len - 1})")
    out = []
    for begin in range(1, num_tokens, stride):
        end = min(begin + stride, num_tokens)
        out.append((max(0, end - max_seq_len), begin, end))
    return out


class PerplexityTask:
    """The ``ppl`` task (see the module docstring)."""

    default_shots = 0

    def load(self, path: Path, settings: EvalSettings) -> TextData:
        """Read the documents under ``path`` (``--max-samples`` keeps the first documents).

        Raises:
            ValueError: a missing path, no documents, or a malformed file.
        """
        path = Path(path)
        require_path(
            path, "perplexity data", "pass a .txt/.raw file, a .jsonl file with a 'text' field, or a directory of them"
        )
        files = sorted(p for p in path.iterdir() if p.suffix in _SUFFIXES) if path.is_dir() else [path]
        documents = [doc for file in files for doc in read_documents(file)]
        documents = limit(documents, settings.max_samples)
        if not documents:
            raise ValueError(f"perplexity data {str(path)!r} holds no text (.txt/.raw files or .jsonl 'text' fields)")
        return TextData(path, documents)

    def check(self, lm: Any, settings: EvalSettings) -> None:
        """The stride must fit the window.

        Raises:
            ValueError: ``--ppl-stride`` not below ``max_seq_len``.
        """
        windows(2, lm.max_seq_len, settings.ppl_stride or lm.max_seq_len - 1)

    def run(self, lm: Any, data: TextData, settings: EvalSettings) -> TaskResult:
        """Sum the NLL of every scored token; report perplexity, mean NLL and the token count."""
        stride = settings.ppl_stride or lm.max_seq_len - 1
        requests, owners = [], []
        for index, text in enumerate(data.documents):
            ids = encode_context(lm.tokenizer, text)
            for start, begin, end in windows(len(ids), lm.max_seq_len, stride):
                requests.append((ids[start:begin], ids[begin:end]))
                owners.append(index)
        if not requests:
            raise ValueError(f"perplexity data {str(data.path)!r} tokenizes to single tokens only; nothing to score")
        scores = call_in_chunks(lm.loglikelihood, requests, lm, "ppl", settings)
        nll = [0.0] * len(data.documents)
        tokens = [0] * len(data.documents)
        for owner, (_, continuation), score in zip(owners, requests, scores):
            nll[owner] -= score
            tokens[owner] += len(continuation)
        total_nll, total_tokens = sum(nll), sum(tokens)
        mean_nll = total_nll / total_tokens
        samples = [{"index": i, "nll": nll[i], "tokens": tokens[i]} for i in range(len(data.documents))]
        return TaskResult(
            task="ppl",
            metric="ppl",
            value=math.exp(mean_nll),
            n=total_tokens,
            metrics={"ppl": math.exp(mean_nll), "nll": mean_nll, "tokens": total_tokens},
            samples=samples,
            settings={
                "data": str(data.path),
                "documents": len(data.documents),
                "max_seq_len": lm.max_seq_len,
                "stride": stride,
            },
        )


TASKS.register("ppl", PerplexityTask())
