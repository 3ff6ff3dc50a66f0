"""The tool-using demo policy: a tiny Llama that answers two-digit products, sometimes with the calculator.

A product of two two-digit numbers is beyond what the tiny demo Llama computes in its head, but
copying is not: the warm start (a short supervised fit, as :mod:`mindspeed_rl.demo.model`'s)
shows it, for a share :attr:`ToolDemoSettings.call_fraction` of the training prompts, the
calculator path (call ``calculator`` with the question's expression, then copy the tool's
result into ``#### N``) and, for the others, the right product answered directly, which it
cannot learn. The starting policy then calls the tool on part of its samples and is mostly
right when it does, wrong when it does not: GRPO has a reason to raise the call rate.

The fit weights its loss per token so that the tool path is learnt well in a short, cheap fit
and the decision to call is not: the call and the copy of the result weigh
:attr:`ToolDemoSettings.call_weight`, the direct answer :attr:`ToolDemoSettings.direct_weight`
(less, so that the fit does not memorise the training products), and the first token of the
response (``<tool_call>`` or `` #### ``: the decision) weighs 1 on every row, so the policy
calls the tool with about the probability it was shown the call (greedy: not at all).

The chat template is compact (the tools' names, not their schemas, so prompts stay short on a
character-level tokenizer) and extends turn by turn, as the agent loop needs::

    <s>Tools: calculator
    Question: What is 37 * 59?
    Answer:<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 59"}}</tool_call></s>
    <tool_response>2183</tool_response>
    Answer: #### 2183</s>

``actor.model: demo-tools`` stands for this policy (built once into a cache directory, see
:func:`mindspeed_rl.demo.model.resolve_model`); ``examples/rl/grpo_tools_tiny_cpu.yaml`` trains it.
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
from mindspeed_rl.demo.model import CHARACTERS, DEMO_MODELS, DemoPolicySettings, _llama_config
from mindspeed_rl.tools import build_tools, tool_schemas

logger = get_logger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
PIECES = ("Tools: calculator\n", "Question: ", "What is ", "?\n", "Answer:", " #### ", " * ")
#: The call's fixed text, one token each wherever it appears (a call is 9 tokens: short to fit and to sample).
CALL_PIECES = (CALL_HEAD, CALL_TAIL)
CHAT_TEMPLATE = (  # newlines as expressions: transformers renders templates with trim_blocks
    "{{ bos_token }}{% if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}{{ '\\n' }}"
    "{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'user' %}Question: {{ message['content'] }}{{ '\\n' }}Answer:"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}{{ '\\n' }}<tool_response>{{ message['content'] }}</tool_response>"
    "{{ '\\n' }}Answer:{% endif %}{% endfor %}"
)


#: The model name that stands for this policy in recipes (``actor.model: demo-tools``).
TOOLS_DEMO_MODEL = "demo-tools"
#: Bumped whenever the builder's output changes, so stale caches are not reused.
TOOLS_BUILDER_VERSION = 1
WARMUP_STEPS = 30  # of the fit's learning rate, then a linear decay to a tenth


@dataclass(frozen=True)
class ToolDemoSettings:
    """The warm start.

    Attributes:
        policy: the shape and fit of :class:`~mindspeed_rl.demo.model.DemoPolicySettings`
            (``label_smoothing`` applies to every fitted token).
        call_fraction: the share of fitted prompts shown the calculator path.
        call_weight: loss weight of the calculator path's tokens (the call, the copied answer).
        direct_weight: loss weight of the direct answer's tokens.
    """

    policy: DemoPolicySettings = DemoPolicySettings(fit_steps=400, batch_size=64, label_smoothing=0.0)
    call_fraction: float = 0.3
    call_weight: float = 3.0
    direct_weight: float = 0.3


def build_tools_tokenizer() -> Any:
    """Characters, the prompt pieces, the call's fixed text and the tool markers as single tokens;
    ``</s>`` ends a turn."""
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
    core.add_tokens(list(CALL_PIECES))  # matched before BPE, decoded always (not special)
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


def _fit_tensors(tokenizer: Any, records: list[Any], s: ToolDemoSettings) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, labels (-100: no loss) and per-token loss weights of the fitted rows."""
    schemas = tool_schemas(build_tools(["calculator"]))
    calls = [(i * 7919 % 100) < s.call_fraction * 100 for i in range(len(records))]
    rows = [_row(tokenizer, r.prompt, r.reference or "", call, schemas) for r, call in zip(records, calls)]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id, dtype=torch.long)
    target = torch.full((len(rows), width), -100, dtype=torch.long)
    weight = torch.zeros(len(rows), width)
    for i, ((row, label), call) in enumerate(zip(rows, calls)):
        ids[i, : len(row)] = torch.tensor(row)
        target[i, : len(label)] = torch.tensor(label)
        learnt = target[i] != -100
        weight[i, learnt] = s.call_weight if call else s.direct_weight
        weight[i, int(learnt.float().argmax())] = 1.0  # the decision: called with the shown frequency
    return ids, target, weight


def fit_tools_policy(data: str | Path, seed: int = 0, settings: ToolDemoSettings | None = None) -> tuple[Any, Any]:
    """The warm-started model and its tokenizer (in memory), fitted on the records of ``data``."""
    from transformers import LlamaForCausalLM

    s = settings or ToolDemoSettings()
    p = s.policy
    tokenizer = build_tools_tokenizer()
    records = load_prompts(data)
    records = records[: max(1, round(len(records) * p.fit_fraction))]
    ids, target, weight = _fit_tensors(tokenizer, records, s)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(tokenizer, p))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
    steps = max(p.fit_steps, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: min(1.0, (k + 1) / WARMUP_STEPS) * max(0.1, 1.0 - k / steps)
    )
    loss = torch.zeros(())
    for _ in range(p.fit_steps):
        pick = torch.randint(len(records), (min(p.batch_size, len(records)),), generator=generator)
        logits = model(input_ids=ids[pick]).logits[:, :-1]
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target[pick][:, 1:].reshape(-1),
            ignore_index=-100,
            label_smoothing=p.label_smoothing,
            reduction="none",
        )
        w = weight[pick][:, 1:].reshape(-1)
        loss = (per_token * w).sum() / w.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
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


DEMO_MODELS.register(
    TOOLS_DEMO_MODEL, (f"tools-policy-v{TOOLS_BUILDER_VERSION}", lambda out, seed: build_tools_policy(out, seed=seed))
)
