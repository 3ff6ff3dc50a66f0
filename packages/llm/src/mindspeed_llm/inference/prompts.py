"""Prompts for ``generate``: reading them from files and turning them into token ids.

A prompt record is a plain string, or a dict with ``messages`` (a chat), ``prompt``, ``text``, or
``instruction`` (with an optional ``input``, Alpaca style). With ``chat`` on, text prompts become a
user message (after the optional system message) and go through the tokenizer's chat template;
records with ``messages`` always do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: Keys of a record that hold its text, in the order they are tried.
_TEXT_KEYS = ("prompt", "text", "instruction")


def read_prompts(path: Path) -> list[Any]:
    """Prompt records of ``path``: one JSON value per line for ``.jsonl``/``.json``, else one text per line.

    ``-`` is standard input; pipes and other non-regular files (``/dev/stdin``, ``<(...)``) are read too.

    Raises:
        ValueError: a missing file, an unreadable JSON line, a record without text, or no prompts at all.
    """
    lines = _read_lines(path)
    records: list[Any] = []
    as_json = path.suffix in (".jsonl", ".json")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not as_json:
            records.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not valid JSON ({err.msg}); write one JSON value per line") from None
        if not isinstance(record, str) and not (
            isinstance(record, dict) and ("messages" in record or any(k in record for k in _TEXT_KEYS))
        ):
            raise ValueError(
                f"{path}:{number} has no prompt: give a string or an object with messages, {', '.join(_TEXT_KEYS)}"
            )
        records.append(record)
    if not records:
        raise ValueError(f"--prompts-file {path} holds no prompts")
    return records


def _read_lines(path: Path) -> list[str]:
    if str(path) == "-":
        return sys.stdin.read().splitlines()
    if not path.exists():
        raise ValueError(f"--prompts-file {path} does not exist")
    if path.is_dir():
        raise ValueError(
            f"--prompts-file {path} is a directory; give a file with one prompt per line, or - for standard input"
        )
    with open(path, encoding="utf-8") as lines:  # not read_text: a pipe (/dev/stdin) is no regular file
        return lines.read().splitlines()


def prompt_text(record: Any) -> str:
    """The text of a record (a chat's last message for ``messages``)."""
    if isinstance(record, str):
        return record
    if "messages" in record:
        return str(record["messages"][-1]["content"]) if record["messages"] else ""
    if "instruction" in record and "prompt" not in record and "text" not in record:
        return "\n".join(part for part in (record["instruction"], record.get("input")) if part)
    return str(record.get("prompt", record.get("text", "")))


def encode_prompt(tokenizer: Any, record: Any, chat: bool, system: str | None) -> list[int]:
    """Token ids of a prompt record.

    Args:
        tokenizer: a transformers tokenizer.
        record: the record (see the module docstring).
        chat: apply the chat template to text prompts.
        system: system message put first in chats built from text.

    Raises:
        ValueError: a chat prompt and a tokenizer without a chat template.
    """
    messages = record.get("messages") if isinstance(record, dict) else None
    if messages is None and not chat:
        return list(tokenizer(prompt_text(record))["input_ids"])
    if messages is None:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt_text(record)}
        ]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template; drop --chat (and messages prompts) or pass --hf-cfg-dir "
            "with a tokenizer that has one"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
