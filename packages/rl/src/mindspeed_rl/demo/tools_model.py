"""The tool-using demo policy: a tiny Llama that answers two-digit products, sometimes with the calculator.

A product of two two-digit numbers is beyond what the tiny demo Llama computes in its head, but
copying is not: the warm start (a short supervised fit, as :mod:`mindspeed_rl.demo.model`'s)
shows it, for a share :attr:`ToolDemoSettings.call_fraction` of the training prompts, the
calculator path (call ``calculator`` with the question's expression, then copy the tool's
result into ``#### N``) and, for the others, the right product answered directly, which it
cannot learn. The starting policy then calls the tool on part of its samples and is mostly
right when it does, mostly wrong when it does not: GRPO has a reason to raise the call rate.

The chat template is compact (the tools' names, not their schemas, so prompts stay short on a
character-level tokenizer) and extends turn by turn, as the agent loop needs::

    <s>Tools: calculator
    Question: What is 37 * 59?
    Answer:<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 59"}}</tool_call></s>
    <tool_response>2183</tool_response>
    Answer: #### 2183</s>

Not wired into a recipe yet (``examples/rl/grpo_tools_tiny_cpu.yaml`` is left; see docs/rl/tools.md):
:func:`build_tools_policy` writes the directory a recipe's ``actor.model`` can name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.evaluation.math_answer import reference_answer
from mindspeed.log import get_logger
from mindspeed_rl.data import load_prompts
from mindspeed_rl.demo.model import CHARACTERS, DemoPolicySettings, _llama_config
from mindspeed_rl.tools import build_tools, tool_schemas

logger = get_logger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
PIECES = ("Tools: calculator\n", "Question: ", "What is ", "?\n", "Answer:", " #### ", " * ", CALL_HEAD, CALL_TAIL)
CHAT_TEMPLATE = (  # newlines as expressions: transformers renders templates with trim_blocks
    "{{ bos_token }}{% if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}{{ '\\n' }}"
    "{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'user' %}Question: {{ message['content'] }}{{ '\\n' }}Answer:"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}{{ '\\n' }}<tool_response>{{ message['content'] }}</tool_response>"
    "{{ '\\n' }}Answer:{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class ToolDemoSettings:
    """The warm start: the shape and fit of :class:`~mindspeed_rl.demo.model.DemoPolicySettings`, and
    ``call_fraction``, the share of fitted prompts shown the calculator path."""

    policy: DemoPolicySettings = DemoPolicySettings(fit_steps=600)
    call_fraction: float = 0.3


def build_tools_tokenizer() -> Any:
    """Characters, the prompt pieces and the tool markers as single tokens; ``</s>`` ends a turn."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    merges = []
    for piece in PIECES:
        for end in range(2, len(piece) + 1):
            if piece[:end] not in vocab:
                merges.append((piece[: end - 1], piece[end - 1]))
                vocab[piece[:end]] = len(vocab)
    core = Tokenizer(BPE(vocab, merges, unk_token="<unk>"))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _row(tokenizer: Any, question: str, reference: str, call: bool, schemas: list[Any]) -> tuple[list[int], list[int]]:
    """Ids and labels of one fitted conversation (labels only on what the policy writes)."""
    value = reference_answer(reference)
    expression = question.removeprefix("What is ").removesuffix("?")
    pieces: list[tuple[str, bool]] = [
        (tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=schemas, tokenize=False), False)
    ]
    if call:
        pieces += [
            ("<tool_call>" + CALL_HEAD + expression + CALL_TAIL + "</tool_call>", True),
            ("</s>\n<tool_response>" + str(value) + "</tool_response>\nAnswer:", False),
        ]
    pieces.append((f" #### {value}</s>", True))
    ids: list[int] = []
    labels: list[int] = []
    for text, learn in pieces:
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += part
        labels += part if learn else [-100] * len(part)
    return ids, labels


def fit_tools_policy(data: str | Path, seed: int = 0, settings: ToolDemoSettings | None = None) -> tuple[Any, Any]:
    """The warm-started model and its tokenizer (in memory), fitted on the records of ``data``."""
    from transformers import LlamaForCausalLM

    s = settings or ToolDemoSettings()
    p = s.policy
    tokenizer = build_tools_tokenizer()
    schemas = tool_schemas(build_tools(["calculator"]))
    records = load_prompts(data)
    records = records[: max(1, round(len(records) * p.fit_fraction))]
    rows = [
        _row(tokenizer, r.prompt, r.reference or "", (i * 7919 % 100) < s.call_fraction * 100, schemas)
        for i, r in enumerate(records)
    ]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id, dtype=torch.long)
    target = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, label) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        target[i, : len(label)] = torch.tensor(label)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(tokenizer, p))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
    loss = torch.zeros(())
    for _ in range(p.fit_steps):
        pick = torch.randint(len(rows), (min(p.batch_size, len(rows)),), generator=generator)
        logits = model(input_ids=ids[pick]).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target[pick][:, 1:].reshape(-1),
            ignore_index=-100,
            label_smoothing=p.label_smoothing,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    logger.info("tools demo policy: %d fit steps, final loss %.3f", p.fit_steps, float(loss.detach()))
    return model.eval(), tokenizer


def build_tools_policy(
    out_dir: str | Path, data: str | Path = "demo-products", seed: int = 0, settings: ToolDemoSettings | None = None
) -> Path:
    """Write the tool-using demo policy as a Hugging Face directory (atomically); returns ``out_dir``.

    Raises:
        ValueError: ``out_dir`` exists and is not an empty directory.
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--output-dir {str(out)!r} exists and is not empty; give a new directory")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = fit_tools_policy(data, seed, settings)
    finally:
        torch.set_num_threads(previous)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(str(tmp))
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        ).save_pretrained(tmp)
        with contextlib.suppress(OSError):
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
