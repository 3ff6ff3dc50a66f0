"""Dataset handlers: one record in, token id sequences out, registered by MindSpeed-LLM's names.

A handler declares the datasets it writes (``output_keys``, named
``{prefix}{output_suffix}_{key}_document``) and turns one record (a ``dict`` of columns) into
one sequence per key. A record it cannot use raises :class:`BadRecordError`, which the
pipeline reports with the record's file and line, or counts under ``--skip-bad-records``.

``--map-keys`` renames the columns a handler reads, with LLaMA-Factory's attribute names as
MindSpeed-LLM documents them (``{"prompt": "question", "query": ""}``: an empty value turns a
column off).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from mindspeed.registry import Registry
from mindspeed_llm.data.templates import BadRecordError, ConversationEncoder, encode_text

#: ``--handler-name`` -> handler class.
HANDLERS: Registry[type[DatasetHandler]] = Registry("dataset handler")

SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "system_tag": "system",
    "observation_tag": "observation",
    "function_tag": "function_call",
}


class DatasetHandler:
    """Base class: subclasses set the class attributes and implement :meth:`encode`.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        options: the run's settings (a ``PreprocessConfig``).
    """

    #: inserted between the output prefix and ``_{key}_document``.
    output_suffix: ClassVar[str] = "_packed"
    #: the datasets written, in order.
    output_keys: ClassVar[tuple[str, ...]] = ()
    #: ``--map-keys`` attribute -> default column ("" = not read unless mapped).
    default_columns: ClassVar[dict[str, Any]] = {}
    #: ``--pack`` is allowed.
    packable: ClassVar[bool] = False

    def __init__(self, tokenizer: Any, options: Any) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.columns = self.resolve_columns(options.map_keys)

    @classmethod
    def resolve_columns(cls, map_keys: dict[str, Any] | None) -> dict[str, Any]:
        """The defaults updated with ``map_keys``; unknown attribute names are a ``ValueError``."""
        columns = dict(cls.default_columns)
        for key, value in (map_keys or {}).items():
            if key not in columns:
                raise ValueError(f"--map-keys: {cls.__name__} has no attribute {key!r} (known: {', '.join(columns)})")
            columns[key] = value
        return columns

    def output_names(self) -> tuple[str, ...]:
        """The output keys (``GeneralPretrainHandler`` takes them from ``--json-keys``)."""
        return self.output_keys

    def encode(self, record: dict[str, Any]) -> dict[str, np.ndarray | None]:
        """One sequence per output key (``None``: nothing to write for that key).

        Raises:
            BadRecordError: the record lacks a field or has one of the wrong type.
        """
        raise NotImplementedError

    def sample_length(self, encoded: dict[str, np.ndarray | None]) -> int:
        """Length compared with ``--seq-length`` (0: never too long)."""
        return 0

    # -- helpers for subclasses ----------------------------------------------------------
    def _field(self, record: dict[str, Any], attribute: str, required: bool = True, kind: type | tuple = str) -> Any:
        column = self.columns.get(attribute)
        if not column:
            return None
        if column not in record or record[column] is None:
            if required:
                raise BadRecordError(
                    f"missing key {column!r} (the record has: {', '.join(map(str, record)) or 'nothing'})"
                )
            return None
        value = record[column]
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise BadRecordError(f"key {column!r} must be {names}, got {type(value).__name__}")
        return value


def _int32(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


@HANDLERS.register("GeneralPretrainHandler")
class GeneralPretrainHandler(DatasetHandler):
    """Plain text for pretraining: each ``--json-keys`` column becomes ``{prefix}_{key}_document``.

    The text is tokenized as ``tokenizer(text)`` does (special tokens the tokenizer adds
    included); ``--append-eod`` adds the EOS id. Empty texts are counted, not written.
    """

    output_suffix = ""
    packable = False

    def __init__(self, tokenizer: Any, options: Any) -> None:
        self.keys = tuple(options.json_keys or ("text",))
        super().__init__(tokenizer, options)
        if options.append_eod and tokenizer.eos_token_id is None:
            raise ValueError("--append-eod needs an EOS token, and the tokenizer has no eos_token")

    @classmethod
    def resolve_columns(cls, map_keys: dict[str, Any] | None) -> dict[str, Any]:
        # Any output key may be read from a column of another name.
        return dict(map_keys or {})

    def output_names(self) -> tuple[str, ...]:
        return self.keys

    def encode(self, record: dict[str, Any]) -> dict[str, np.ndarray | None]:
        out: dict[str, np.ndarray | None] = {}
        for key in self.keys:
            column = self.columns.get(key, key)
            if column not in record or record[column] is None:
                raise BadRecordError(
                    f"missing key {column!r} (the record has: {', '.join(map(str, record)) or 'nothing'})"
                )
            text = record[column]
            if not isinstance(text, str):
                raise BadRecordError(f"key {column!r} must be str, got {type(text).__name__}")
            if not text.strip():
                out[key] = None
                continue
            ids = encode_text(self.tokenizer, text, add_special_tokens=True)
            if self.options.append_eod:
                ids.append(self.tokenizer.eos_token_id)
            out[key] = _int32(ids)
        return out


class _ConversationHandler(DatasetHandler):
    """Shared by the instruction and pairwise handlers: turns a record into messages."""

    def __init__(self, tokenizer: Any, options: Any) -> None:
        super().__init__(tokenizer, options)
        self.encoder = ConversationEncoder(tokenizer, options.prompt_type)

    def _alpaca_prompt(self, record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        messages: list[dict[str, str]] = []
        for i, pair in enumerate(self._field(record, "history", required=False, kind=list) or []):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise BadRecordError(f"history entry {i} must be a [prompt, response] pair of strings")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        parts = [self._field(record, "prompt"), self._field(record, "query", required=False)]
        messages.append({"role": "user", "content": "\n".join(p for p in parts if p)})
        return self._field(record, "system", required=False) or "", messages

    def _sharegpt_messages(self, record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        tags = self.columns["tags"]
        roles = {
            tags["user_tag"]: "user",
            tags["assistant_tag"]: "assistant",
            tags["observation_tag"]: "observation",
            tags["function_tag"]: "function",
        }
        raw = self._field(record, "messages", kind=list)
        system = self._field(record, "system", required=False) or ""
        messages = []
        for i, message in enumerate(raw):
            if not isinstance(message, dict) or tags["role_tag"] not in message or tags["content_tag"] not in message:
                raise BadRecordError(
                    f"message {i} must be an object with {tags['role_tag']!r} and {tags['content_tag']!r}"
                )
            role = message[tags["role_tag"]]
            if i == 0 and role == tags["system_tag"]:
                system = message[tags["content_tag"]]
                continue
            if role not in roles:
                raise BadRecordError(f"message {i} has unknown role {role!r} (known: {', '.join(map(str, roles))})")
            messages.append({"role": roles[role], "content": message[tags["content_tag"]]})
        if not isinstance(system, str):
            raise BadRecordError(f"system must be a string, got {type(system).__name__}")
        return system, messages

    def _reply(self, record: dict[str, Any], attribute: str) -> dict[str, str]:
        value = self._field(record, attribute, kind=(str, dict))
        if isinstance(value, dict):  # ShareGPT pairs: {"from": "gpt", "value": "..."}
            tags = self.columns.get("tags", SHAREGPT_TAGS)
            if not isinstance(value.get(tags["content_tag"]), str):
                raise BadRecordError(f"{attribute} must hold a string {tags['content_tag']!r}")
            return {"role": "assistant", "content": value[tags["content_tag"]]}
        return {"role": "assistant", "content": value}


class _InstructionHandler(_ConversationHandler):
    output_keys = ("input_ids", "attention_mask", "labels")
    packable = True

    def _conversation(self, record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        raise NotImplementedError

    def encode(self, record: dict[str, Any]) -> dict[str, np.ndarray | None]:
        system, messages = self._conversation(record)
        input_ids, labels = self.encoder.encode(system, messages)
        if self.options.append_eod:
            input_ids, labels = input_ids + [self.tokenizer.eos_token_id], labels + [self.tokenizer.eos_token_id]
        return {
            "input_ids": _int32(input_ids),
            "attention_mask": np.ones(len(input_ids), dtype=np.int32),
            "labels": _int32(labels),
        }

    def sample_length(self, encoded: dict[str, np.ndarray | None]) -> int:
        return len(encoded["input_ids"])


@HANDLERS.register("AlpacaStyleInstructionHandler")
class AlpacaStyleInstructionHandler(_InstructionHandler):
    """Alpaca records (``instruction``, ``input``, ``output``, optional ``system``, ``history``).

    The prompt is ``instruction\\ninput`` after the history turns; labels are -100 on every
    prompt token and the ids on every reply.
    """

    default_columns = {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
    }

    def _conversation(self, record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        system, messages = self._alpaca_prompt(record)
        return system, messages + [{"role": "assistant", "content": self._field(record, "response")}]


@HANDLERS.register("SharegptStyleInstructionHandler")
class SharegptStyleInstructionHandler(_InstructionHandler):
    """ShareGPT records: a ``conversations`` list of ``{"from", "value"}`` ending with a reply.

    ``--map-keys '{"messages": "messages", "tags": {"role_tag": "role", ...}}'`` reads the
    OpenAI layout; a first message with the system tag is the system text.
    """

    default_columns = {"messages": "conversations", "system": "system", "tags": SHAREGPT_TAGS}

    @classmethod
    def resolve_columns(cls, map_keys: dict[str, Any] | None) -> dict[str, Any]:
        return _resolve_sharegpt(cls, map_keys)

    def _conversation(self, record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        return self._sharegpt_messages(record)


class _PairwiseHandler(_ConversationHandler):
    output_keys = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")

    def _prompt(self, record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        raise NotImplementedError

    def encode(self, record: dict[str, Any]) -> dict[str, np.ndarray | None]:
        system, prompt = self._prompt(record)
        out = {}
        for side in ("chosen", "rejected"):
            input_ids, labels = self.encoder.encode(system, prompt + [self._reply(record, side)], train_last_only=True)
            out[f"{side}_input_ids"], out[f"{side}_labels"] = _int32(input_ids), _int32(labels)
        # A pair whose answers tokenize the same teaches nothing (a reward model's loss stays at
        # log 2): most often a chat template that renders the prompts and drops the replies.
        if np.array_equal(out["chosen_input_ids"], out["rejected_input_ids"]):
            raise BadRecordError(
                "chosen and rejected give the same tokens (a chat template that drops the replies?); "
                "pass --prompt-type (data.prompt_type), or give answers that differ"
            )
        return out

    def sample_length(self, encoded: dict[str, np.ndarray | None]) -> int:
        return max(len(encoded["chosen_input_ids"]), len(encoded["rejected_input_ids"]))


@HANDLERS.register("AlpacaStylePairwiseHandler")
class AlpacaStylePairwiseHandler(_PairwiseHandler):
    """Alpaca preference pairs: ``instruction``, ``input``, ``chosen``, ``rejected`` (strings).

    Labels are -100 on everything but the final reply (history replies included).
    """

    default_columns = {
        "prompt": "instruction",
        "query": "input",
        "chosen": "chosen",
        "rejected": "rejected",
        "system": "system",
        "history": "history",
    }

    def _prompt(self, record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        return self._alpaca_prompt(record)


@HANDLERS.register("SharegptStylePairwiseHandler")
class SharegptStylePairwiseHandler(_PairwiseHandler):
    """ShareGPT preference pairs: ``conversations`` ending with a prompt, ``chosen`` and ``rejected``.

    ``chosen``/``rejected`` are ``{"from": "gpt", "value": ...}`` objects (or plain strings).
    """

    default_columns = {
        "messages": "conversations",
        "system": "system",
        "chosen": "chosen",
        "rejected": "rejected",
        "tags": SHAREGPT_TAGS,
    }

    @classmethod
    def resolve_columns(cls, map_keys: dict[str, Any] | None) -> dict[str, Any]:
        return _resolve_sharegpt(cls, map_keys)

    def _prompt(self, record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        return self._sharegpt_messages(record)


def _resolve_sharegpt(cls: type[DatasetHandler], map_keys: dict[str, Any] | None) -> dict[str, Any]:
    """ShareGPT columns: ``tags`` is merged over the defaults, key by key."""
    map_keys = dict(map_keys or {})
    tags = map_keys.pop("tags", None) or {}
    if not isinstance(tags, dict):
        raise ValueError('--map-keys: \'tags\' must be an object, e.g. {"role_tag": "role"}')
    unknown = set(tags) - set(SHAREGPT_TAGS)
    if unknown:
        raise ValueError(f"--map-keys: unknown tags {', '.join(sorted(unknown))} (known: {', '.join(SHAREGPT_TAGS)})")
    columns = DatasetHandler.resolve_columns.__func__(cls, map_keys)
    columns["tags"] = {**SHAREGPT_TAGS, **tags}
    return columns
