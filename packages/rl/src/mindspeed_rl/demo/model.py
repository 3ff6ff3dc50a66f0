"""The demo starting policy: a tiny Llama that is right on the shipped arithmetic set some of the time.

GRPO only learns from groups whose rewards differ, so a randomly initialised model (reward ~0 on
arithmetic) teaches nothing. :func:`build_demo_policy` writes a Hugging Face directory (config,
safetensors, a character-level tokenizer) whose weights are warm-started by a short supervised
fit on the shipped training prompts (:data:`~mindspeed_rl.data.arithmetic.DEMO_TRAIN`): it
answers in GSM8K's ``#### N`` form that the ``math`` verifier reads and is right on a fraction
of the prompts, which leaves the reward room to rise. The build is deterministic in its seed
and takes about a minute on one idle CPU core (the fit has a phase change: at 400 steps it is
right on ~20 % of the training prompts greedily, at 700 on ~80 %, ~35 % when sampled).

The tokenizer has one token per digit (as the arithmetic needs), per other character, and per
frequent piece of the prompts (``What is ``, `` #### ``, ...), and a
chat template that renders exactly the plain format ``<s>Question: {prompt}\\nAnswer:``, so
``data.prompt_format`` ``plain`` and ``chat`` give the same token ids.

``actor.model: demo`` stands for this policy: :func:`resolve_model` builds it once into a cache
directory (default :data:`DEFAULT_CACHE_DIR`, relative to the working directory) and returns
its path. Other demo policies register in :data:`DEMO_MODELS` (``demo-tools``:
:mod:`mindspeed_rl.demo.tools_model`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.evaluation.math_answer import reference_answer
from mindspeed.log import get_logger
from mindspeed.registry import Registry
from mindspeed_llm.engine import SamplingParams
from mindspeed_rl.data import PromptFormat, encode_prompts, load_prompts
from mindspeed_rl.rewards.math import MathVerifier

logger = get_logger(__name__)

#: The model name that stands for the demo policy in recipes (``actor.model: demo``).
DEMO_MODEL = "demo"
#: Where :func:`resolve_model` caches the demo policy when no directory is given.
DEFAULT_CACHE_DIR = Path("runs/rl-demo-model")
#: Bumped whenever the builder's output changes, so stale caches are not reused.
BUILDER_VERSION = 3
#: The plain prompt format the policy is fitted on (``data.prompt_template``'s default).
PROMPT_TEMPLATE = "Question: {prompt}\nAnswer:"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# Printable ASCII and the newline: any text can be tokenized, digits always one by one.
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]
# Frequent pieces of the prompts and answers are single tokens (no digits among them), which
# makes a sequence ~13 tokens instead of ~45 characters: a faster fit and faster rollouts.
PIECES = ("Question: ", "What is ", "?\n", "Answer:", " #### ", " + ", " - ", " * ", " = ")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "Question: {{ message['content'] }}\nAnswer:{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class DemoPolicySettings:
    """Shape and warm-start of the demo policy.

    Attributes:
        hidden_size, intermediate_size, num_layers, num_heads: the Llama's shape.
        fit_steps: AdamW steps of the supervised warm start (more steps: a better start).
        batch_size: sequences per step. lr: AdamW learning rate. weight_decay: AdamW decay.
        label_smoothing: of the fit's cross-entropy. It keeps probability on the other tokens,
            so sampled answers (temperature 1) are right less often than greedy ones: the
            room GRPO's reward has to rise by sharpening the policy.
        fit_fraction: the share of the training prompts the warm start sees (the rest it
            has to generalise to).
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    fit_steps: int = 700
    batch_size: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.0
    label_smoothing: float = 0.15
    fit_fraction: float = 1.0


def build_tokenizer() -> Any:
    """The character-level fast tokenizer: BOS before each text, ``</s>`` ends an answer.

    Returns:
        A ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    # BPE starts from characters; each piece is built by a chain of merges (prefix + next
    # character), whose pairs no other piece shares. Fuse joins the tokens back on decode.
    merges = []
    for piece in PIECES:
        for end in range(2, len(piece) + 1):
            merges.append((piece[: end - 1], piece[end - 1]))
            vocab.setdefault(piece[:end], len(vocab))
    core = Tokenizer(BPE(vocab, merges, unk_token="<unk>"))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()
    core.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def answer_text(reference: str) -> str:
    """The response the policy is fitted to give for a GSM8K-style reference: `` #### N``."""
    return f" #### {reference_answer(reference)}"


def _fit_rows(tokenizer: Any, records: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[rows, len]`` ids and labels (-100 outside the answer and its ``</s>``)."""
    rows, labels = [], []
    for record in records:
        prompt = tokenizer(PROMPT_TEMPLATE.replace("{prompt}", record.prompt))["input_ids"]
        answer = tokenizer(answer_text(record.reference), add_special_tokens=False)["input_ids"]
        rows.append(prompt + answer + [tokenizer.eos_token_id])
        labels.append([-100] * len(prompt) + answer + [tokenizer.eos_token_id])
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id, dtype=torch.long)
    target = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, label) in enumerate(zip(rows, labels)):
        ids[i, : len(row)] = torch.tensor(row)
        target[i, : len(label)] = torch.tensor(label)
    return ids, target


def _llama_config(tokenizer: Any, s: DemoPolicySettings) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        architectures=["LlamaForCausalLM"],
    )


def fit_demo_policy(seed: int = 0, settings: DemoPolicySettings | None = None) -> tuple[Any, Any]:
    """The warm-started model and its tokenizer (in memory).

    Args:
        seed: seeds the initial weights and the order of the fit's batches.
        settings: shape and warm start (default :class:`DemoPolicySettings`).

    Returns:
        ``(LlamaForCausalLM in eval mode, tokenizer)``.
    """
    from transformers import LlamaForCausalLM

    s = settings or DemoPolicySettings()
    tokenizer = build_tokenizer()
    records = load_prompts("demo")
    records = records[: max(1, round(len(records) * s.fit_fraction))]
    ids, target = _fit_rows(tokenizer, records)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(tokenizer, s))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    loss = torch.zeros(())
    for _ in range(s.fit_steps):
        pick = torch.randint(len(records), (min(s.batch_size, len(records)),), generator=generator)
        logits = model(input_ids=ids[pick]).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target[pick][:, 1:].reshape(-1),
            ignore_index=-100,
            label_smoothing=s.label_smoothing,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    logger.info("demo policy: %d fit steps, final loss %.3f", s.fit_steps, float(loss.detach()))
    return model.eval(), tokenizer


def build_demo_policy(out_dir: str | Path, seed: int = 0, settings: DemoPolicySettings | None = None) -> Path:
    """Write the demo starting policy as a Hugging Face directory (atomically).

    Args:
        out_dir: the directory to write (must not exist, or be empty).
        seed: seeds the weights and the warm start (same seed, same weights).
        settings: shape and warm start (default :class:`DemoPolicySettings`).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: ``out_dir`` exists and is not an empty directory.
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--output-dir {str(out)!r} exists and is not empty; give a new directory")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the fit is tiny; one thread is as fast and the weights reproducible
    try:
        model, tokenizer = fit_demo_policy(seed, settings)
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
            out.rmdir()  # an empty directory given by the caller
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


#: Demo policies by the name a recipe's ``actor.model`` gives: (cache folder stem, ``build(out_dir, seed)``).
DEMO_MODELS: Registry[tuple[str, Callable[[Path, int], Path]]] = Registry("demo model")
DEMO_MODELS.register(
    DEMO_MODEL, (f"demo-policy-v{BUILDER_VERSION}", lambda out, seed: build_demo_policy(out, seed=seed))
)


def resolve_model(path_or_demo: str, cache_dir: str | Path | None = None, seed: int = 0) -> str:
    """A demo policy's name (``demo``, see :data:`DEMO_MODELS`) -> its directory (built on first use);
    anything else as given.

    Args:
        path_or_demo: ``actor.model``: a model directory or checkpoint, or a demo policy's name.
        cache_dir: where the demo policy is kept (default :data:`DEFAULT_CACHE_DIR`).
        seed: the demo policy's seed.

    Returns:
        A path the actor and the rollout engine can open.
    """
    if path_or_demo not in DEMO_MODELS:
        return path_or_demo
    stem, build = DEMO_MODELS.get(path_or_demo)
    target = Path(cache_dir or DEFAULT_CACHE_DIR) / f"{stem}-seed{seed}"
    if not (target / "config.json").is_file():
        logger.info("building the %s policy into %s (once)", path_or_demo, target)
        try:
            build(target, seed)
        except (OSError, ValueError):
            # Another process (a second rank, a parallel run) finished the same build first.
            if not (target / "config.json").is_file():
                raise
    return str(target)


def evaluate_accuracy(
    engine: Any,
    tokenizer: Any,
    records: Sequence[Any],
    temperature: float = 0.0,
    n: int = 1,
    max_new_tokens: int = 8,
    seed: int = 0,
) -> float:
    """Mean ``math`` reward of a rollout engine's answers to prompt records (plain format).

    Args:
        engine: an :class:`~mindspeed_llm.inference.InferenceEngine` (``generate``).
        tokenizer: the policy's tokenizer.
        records: :class:`~mindspeed_rl.data.PromptRecord` with references.
        temperature: 0 for greedy answers.
        n: samples per prompt.
        max_new_tokens: the longest answer.
        seed: seeds the samples.

    Returns:
        The fraction of correct answers.
    """
    fmt = PromptFormat(style="plain", template=PROMPT_TEMPLATE)
    ids, kept = encode_prompts([fmt.render(r.prompt) for r in records], tokenizer, add_special_tokens=True)
    prompts = [ids[k] for k in range(len(kept)) for _ in range(n)]
    params = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed * 1_000_003 + i)
        for i in range(len(prompts))
    ]
    outputs = engine.generate(prompts, params)
    verifier = MathVerifier()
    scores = [
        verifier("", tokenizer.decode(out.token_ids, skip_special_tokens=True), records[kept[i // n]].reference)
        for i, out in enumerate(outputs)
    ]
    return sum(scores) / max(len(scores), 1)


__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEMO_MODEL",
    "DEMO_MODELS",
    "DemoPolicySettings",
    "answer_text",
    "build_demo_policy",
    "build_tokenizer",
    "evaluate_accuracy",
    "fit_demo_policy",
    "resolve_model",
]
