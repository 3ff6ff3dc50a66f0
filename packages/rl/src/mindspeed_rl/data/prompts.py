"""Prompts for rollouts: read local jsonl/json/parquet records, format them, tokenize, batch them.

Records are GSM8K-shaped by default (``question`` / ``answer``); ``map_keys`` renames fields
(MindSpeed-RL's ``map_keys``: ``{"prompt": "problem", "reference": "solution"}``). The name
``demo`` stands for the shipped arithmetic training set (``demo-test`` for its test split).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mindspeed_rl.data.arithmetic import DEMO_TEST, DEMO_TRAIN, PRODUCTS_TEST, PRODUCTS_TRAIN

DEFAULT_MAP_KEYS = {"prompt": "question", "reference": "answer"}
#: Names that stand for the shipped data.
DEMO_DATA = {
    "demo": DEMO_TRAIN,
    "demo-test": DEMO_TEST,
    "demo-products": PRODUCTS_TRAIN,
    "demo-products-test": PRODUCTS_TEST,
}
SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class PromptRecord:
    """One prompt: its text, the reference answer (for rule verifiers) and the other fields."""

    prompt: str
    reference: str | None
    index: int
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_data_path(path: str | Path) -> Path:
    """``demo`` / ``demo-test`` -> the shipped files; anything else as given.

    Raises:
        ValueError: if the file does not exist or has an unsupported suffix.
    """
    resolved = DEMO_DATA.get(str(path), Path(path))
    if not resolved.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist (give a .jsonl/.json/.parquet file, or demo)")
    if resolved.suffix not in SUFFIXES:
        raise ValueError(f"data file {str(path)!r}: unsupported format {resolved.suffix!r}; use {', '.join(SUFFIXES)}")
    return resolved


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a jsonl (one object per line), json (a list of objects) or parquet file.

    Raises:
        ValueError: naming the file (and line) that is not a list of objects.
    """
    path = resolve_data_path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"{path}: a .json data file must hold a list of objects (or use .jsonl)")
        return data
    records = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: each line must be a JSON object")
            records.append(record)
    return records


def load_prompts(
    path: str | Path, map_keys: Mapping[str, str] | None = None, limit: int | None = None
) -> list[PromptRecord]:
    """Prompt records of a data file.

    Args:
        path: a .jsonl/.json/.parquet file, or ``demo`` / ``demo-test``.
        map_keys: ``prompt`` and (optionally) ``reference`` -> the field names in the file
            (default ``question`` / ``answer``); a reference field missing from every record
            means no references.
        limit: keep only the first records.

    Raises:
        ValueError: unknown keys in ``map_keys``, or a record without the prompt field (naming it).
    """
    keys = {**DEFAULT_MAP_KEYS, **(map_keys or {})}
    unknown = sorted(set(keys) - set(DEFAULT_MAP_KEYS))
    if unknown:
        raise ValueError(f"data.map_keys: unknown key(s) {', '.join(unknown)}; map prompt and reference only")
    records = read_records(path)[:limit]
    prompt_key, reference_key = keys["prompt"], keys["reference"]
    has_reference = any(reference_key in r for r in records)
    out = []
    for index, record in enumerate(records):
        if not isinstance(record.get(prompt_key), str):
            raise ValueError(
                f"{path}: record {index} has no text field {prompt_key!r} (fields: {', '.join(record)}); "
                f"set data.map_keys.prompt to the field that holds the prompt"
            )
        reference = record.get(reference_key) if has_reference else None
        if has_reference and reference is None:
            raise ValueError(
                f"{path}: record {index} has no {reference_key!r} field while others have; "
                "fix the record or set data.map_keys.reference"
            )
        extra = {k: v for k, v in record.items() if k not in (prompt_key, reference_key)}
        out.append(PromptRecord(record[prompt_key], None if reference is None else str(reference), index, extra))
    return out


@dataclass
class PromptFormat:
    """How a record's prompt becomes the text the policy continues.

    Args:
        style: ``chat`` (the tokenizer's chat template, a user turn and the generation prompt) or
            ``plain`` (``template`` filled in).
        template: the plain format; ``{prompt}`` is replaced by the prompt (with ``instruction``).
        instruction: appended to every prompt (e.g. how to state the final answer).
        system: a system message (chat style).
    """

    style: Literal["chat", "plain"] = "chat"
    template: str = "Question: {prompt}\nAnswer:"
    instruction: str = ""
    system: str | None = None

    def __post_init__(self) -> None:
        if self.style not in ("chat", "plain"):
            raise ValueError(f"prompt style {self.style!r}: use chat or plain")
        if self.style == "plain" and "{prompt}" not in self.template:
            raise ValueError(f"prompt template {self.template!r} has no {{prompt}} placeholder")

    def messages(self, prompt: str) -> list[dict[str, str]]:
        """The chat messages of ``prompt``: the system message (if any) and the user turn."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": prompt + self.instruction}
        ]

    def render(self, prompt: str, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The formatted text of ``prompt`` (chat style: with the tools' schemas rendered in, if any).

        Raises:
            ValueError: chat style without a tokenizer that has a chat template.
        """
        if self.style == "plain":
            return self.template.replace("{prompt}", prompt + self.instruction)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "data.prompt_format=chat needs a tokenizer with a chat template; "
                "set data.prompt_format=plain for a base model"
            )
        return tokenizer.apply_chat_template(
            self.messages(prompt), tools=tools or None, tokenize=False, add_generation_prompt=True
        )


def encode_prompts(
    texts: Sequence[str], tokenizer: Any, max_length: int | None = None, add_special_tokens: bool = False
) -> tuple[list[list[int]], list[int]]:
    """Token ids of formatted prompts, leaving out the ones longer than ``max_length``.

    Chat-formatted text already holds its special tokens, hence ``add_special_tokens=False`` by
    default; pass True for plain prompts to a tokenizer that adds a BOS token.

    Returns:
        (ids of the kept prompts, their positions in ``texts``). Prompts are dropped rather than
        cut, as MindSpeed-RL does: a cut prompt loses its question.
    """
    ids, kept = [], []
    for i, text in enumerate(texts):
        tokens = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if max_length is None or len(tokens) <= max_length:
            ids.append(list(tokens))
            kept.append(i)
    return ids, kept


class PromptSampler:
    """Seeded batches of record indices, epoch after epoch, with a resumable position.

    Every epoch is a fresh permutation (seeded by ``seed`` and the epoch number, so a resumed
    run draws the same batches); the last partial batch of an epoch is dropped.

    Args:
        num_records: records to draw from.
        batch_size: prompts per batch.
        seed: the shuffle seed.
        shuffle: False keeps file order.

    Raises:
        ValueError: if a batch does not fit in the data.
    """

    def __init__(self, num_records: int, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if not 0 < batch_size <= num_records:
            raise ValueError(
                f"prompt batch of {batch_size} with {num_records} records: need 0 < batch <= records "
                "(lower train.global_batch or give more data)"
            )
        self.num_records, self.batch_size, self.seed, self.shuffle = num_records, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        order = list(range(self.num_records))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` record indices."""
        if self.position + self.batch_size > self.num_records:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position to save with a checkpoint."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_records": self.num_records}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a saved position.

        Raises:
            ValueError: if the state was saved for other data or another seed.
        """
        if state["num_records"] != self.num_records or state["seed"] != self.seed:
            raise ValueError(
                f"prompt sampler state is for {state['num_records']} records and seed {state['seed']}, "
                f"not {self.num_records} and {self.seed}: resume with the same data and train.seed"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
