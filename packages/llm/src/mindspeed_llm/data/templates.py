"""From a conversation to token ids and labels: named prompt types, or the tokenizer's chat template.

A conversation is a system text and a list of ``{"role", "content"}`` messages that alternate
a prompt side (``user`` or ``observation``) and a reply side (``assistant`` or ``function``),
ending with a reply. Encoding yields ``input_ids`` and ``labels``: labels are the ids on the
replies the model learns and ``IGNORE_INDEX`` (-100) on everything else (system, prompts, and,
for preference pairs, the earlier replies too).

Two ways to render a conversation:

- ``--prompt-type NAME``: a :class:`PromptTemplate` from :data:`PROMPT_TYPES`. Each prompt and
  each reply is tokenized on its own, so the boundary between masked and trained tokens is
  exact by construction (the LLaMA-Factory convention MindSpeed-LLM follows).
- no prompt type: the tokenizer's own ``chat_template``. Labels come from rendering the
  conversation up to each reply; a template whose renderings are not prefixes of one another
  in token space cannot be masked exactly, and is refused with a hint to use ``--prompt-type``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mindspeed.registry import Registry

IGNORE_INDEX = -100
PROMPT_ROLES = ("user", "observation")
REPLY_ROLES = ("assistant", "function")


class BadRecordError(ValueError):
    """A record that cannot be turned into training data (missing field, wrong type, bad roles)."""


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``, the same as ``tokenizer(text)["input_ids"]``.

    Fast tokenizers are called through their ``tokenizers`` backend one text at a time: the
    batch path spins up a thread pool per call, which costs more than it saves on single
    texts and makes forked workers warn.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _fill(fmt: str, content: str) -> str:
    # str.replace, not str.format: user text may hold braces.
    return fmt.replace("{content}", content)


@dataclass(frozen=True)
class PromptTemplate:
    """How one conversation becomes text, turn by turn.

    Attributes:
        system: format of the system text, put before the first prompt (``{content}`` is replaced).
        user: format of a prompt turn.
        assistant: format of a reply turn (the trained part).
        observation: format of a tool-result turn (default: same as ``user``).
        separator: text before every prompt turn but the first.
        default_system: system text used when a record has none.
        add_bos: put the tokenizer's BOS id before the first turn.
        add_eos: put the tokenizer's EOS id after every reply (trained).
    """

    system: str = "{content}"
    user: str = "{content}"
    assistant: str = "{content}"
    observation: str | None = None
    separator: str = ""
    default_system: str = ""
    add_bos: bool = False
    add_eos: bool = True


#: ``--prompt-type`` name -> template.
PROMPT_TYPES: Registry[PromptTemplate] = Registry("prompt type")
PROMPT_TYPES.register("empty", PromptTemplate())
PROMPT_TYPES.register(
    "default", PromptTemplate(system="System: {content}\n", user="Human: {content}\nAssistant:", separator="\n")
)
PROMPT_TYPES.register(
    "alpaca",
    PromptTemplate(
        system="{content}\n\n",
        user="### Instruction:\n{content}\n\n### Response:\n",
        separator="\n\n",
        default_system="Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    ),
)
_CHATML = dict(
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
    observation="<|im_start|>tool\n{content}<|im_end|>\n<|im_start|>assistant\n",
    assistant="{content}<|im_end|>",
    separator="\n",
    add_eos=False,
)
# GSM8K's plain format, the RL demo's ``data.prompt_template``, as mindspeed-rl's ``reward.model`` scores a
# response: the text ``prompt + response`` tokenized (``<s>Question: ...\nAnswer:<reply>``), no EOS after it.
PROMPT_TYPES.register(
    "question_answer", PromptTemplate(user="Question: {content}\nAnswer:", add_bos=True, add_eos=False)
)
PROMPT_TYPES.register("chatml", PromptTemplate(**_CHATML))
PROMPT_TYPES.register("qwen", PromptTemplate(**_CHATML, default_system="You are a helpful assistant."))
PROMPT_TYPES.register(
    "llama3",
    PromptTemplate(
        system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
        user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        observation="<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        assistant="{content}<|eot_id|>",
        add_bos=True,
        add_eos=False,
    ),
)


def check_conversation(messages: list[dict[str, str]], ends_with_reply: bool = True) -> None:
    """Raise :class:`BadRecordError` unless roles alternate prompt/reply and the end is right."""
    if not messages:
        raise BadRecordError("the conversation has no messages")
    for i, message in enumerate(messages):
        expected = PROMPT_ROLES if i % 2 == 0 else REPLY_ROLES
        if message["role"] not in expected:
            raise BadRecordError(
                f"message {i} has role {message['role']!r} where {' or '.join(expected)} was expected "
                "(turns must alternate prompt and reply)"
            )
        if not isinstance(message["content"], str):
            raise BadRecordError(f"message {i} content must be a string, got {type(message['content']).__name__}")
    if ends_with_reply != (len(messages) % 2 == 0):
        want = "a reply" if ends_with_reply else "a prompt"
        raise BadRecordError(f"the conversation must end with {want} ({len(messages)} messages)")


class ConversationEncoder:
    """Encodes conversations with a named prompt type or the tokenizer's chat template.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        prompt_type: a key of :data:`PROMPT_TYPES`; ``None`` uses ``tokenizer.chat_template``.

    Raises:
        ValueError: unknown prompt type, no chat template to fall back on, or a template that
            needs an EOS/BOS id the tokenizer lacks.
    """

    def __init__(self, tokenizer: Any, prompt_type: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = PROMPT_TYPES.get(prompt_type) if prompt_type is not None else None
        if self.template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer has no chat template; pass --prompt-type (one of: {', '.join(map(str, PROMPT_TYPES))})"
            )
        if self.template is not None and self.template.add_eos and tokenizer.eos_token_id is None:
            raise ValueError(f"prompt type {prompt_type!r} ends replies with EOS, but the tokenizer has no eos_token")
        if self.template is not None and self.template.add_bos and tokenizer.bos_token_id is None:
            raise ValueError(f"prompt type {prompt_type!r} starts with BOS, but the tokenizer has no bos_token")

    def encode(
        self, system: str, messages: list[dict[str, str]], train_last_only: bool = False
    ) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one conversation.

        Args:
            system: system text ("" for none: the template's default applies).
            messages: alternating prompt/reply messages ending with a reply.
            train_last_only: mask every reply but the last (preference pairs).
        """
        check_conversation(messages)
        if self.template is not None:
            return self._encode_template(system, messages, train_last_only)
        return self._encode_chat_template(system, messages, train_last_only)

    def _encode_template(
        self, system: str, messages: list[dict[str, str]], train_last_only: bool
    ) -> tuple[list[int], list[int]]:
        tpl, tok = self.template, self.tokenizer
        input_ids: list[int] = [tok.bos_token_id] if tpl.add_bos else []
        labels: list[int] = [IGNORE_INDEX] * len(input_ids)
        system = system or tpl.default_system
        for turn in range(0, len(messages), 2):
            prompt, reply = messages[turn], messages[turn + 1]
            fmt = tpl.observation if prompt["role"] == "observation" and tpl.observation else tpl.user
            source = (_fill(tpl.system, system) if turn == 0 and system else "") + (tpl.separator if turn else "")
            source_ids = encode_text(tok, source + _fill(fmt, prompt["content"]))
            target_ids = encode_text(tok, _fill(tpl.assistant, reply["content"])) + (
                [tok.eos_token_id] if tpl.add_eos else []
            )
            trained = not train_last_only or turn + 2 == len(messages)
            input_ids += source_ids + target_ids
            labels += [IGNORE_INDEX] * len(source_ids) + (target_ids if trained else [IGNORE_INDEX] * len(target_ids))
        return input_ids, labels

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # noqa: BLE001 -- templates raise jinja errors for conversations they refuse
            raise BadRecordError(
                f"the tokenizer's chat template refused the conversation ({type(err).__name__}: {err}); "
                "fix the record or pass --prompt-type"
            ) from err
        return encode_text(self.tokenizer, text)

    def _encode_chat_template(
        self, system: str, messages: list[dict[str, str]], train_last_only: bool
    ) -> tuple[list[int], list[int]]:
        # Roles the common chat templates know.
        msgs = [
            {
                "role": {"observation": "tool", "function": "assistant"}.get(m["role"], m["role"]),
                "content": m["content"],
            }
            for m in messages
        ]
        head = [{"role": "system", "content": system}] if system else []
        full = self._render(head + msgs, add_generation_prompt=False)
        labels = [IGNORE_INDEX] * len(full)
        replies = range(1, len(msgs), 2) if not train_last_only else [len(msgs) - 1]
        for k in replies:
            start = self._render(head + msgs[:k], add_generation_prompt=True)
            end = self._render(head + msgs[: k + 1], add_generation_prompt=False)
            if full[: len(start)] != start or full[: len(end)] != end or len(end) < len(start):
                raise ValueError(
                    "the tokenizer's chat template does not render conversations as prefixes of each other, "
                    "so prompt tokens cannot be masked exactly; pass --prompt-type "
                    f"(one of: {', '.join(map(str, PROMPT_TYPES))})"
                )
            labels[len(start) : len(end)] = full[len(start) : len(end)]
        return full, labels
