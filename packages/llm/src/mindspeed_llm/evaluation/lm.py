"""The seam between evaluation tasks and a model: the :class:`LM` protocol and its two adapters.

A task turns its data into token-level requests and asks an :class:`LM` for two things only:
the summed log-probability of a continuation given a context (multiple choice, perplexity), and
greedy generations cut at stop strings (GSM8K). :class:`TransformersLM` answers them with a plain
``transformers`` model (the reference path); :class:`EngineLM` answers them with the suite's own
inference engine (:mod:`mindspeed_llm.inference`). Both apply the same truncation rules
(:func:`fit_request`, :func:`fit_prompt`), so the same model gives the same scores either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed_llm.inference import SamplingParams
from mindspeed_llm.tokenizer import load_tokenizer

logger = get_logger(__name__)

#: Longest window used when the model's own limit is larger (or unknown).
DEFAULT_MAX_SEQ_LEN = 4096


@runtime_checkable
class LM(Protocol):
    """What an evaluation task needs from a model.

    Attributes:
        tokenizer: a ``transformers`` tokenizer (encode/decode, ``eos_token``).
        max_seq_len: no sequence fed to the model is longer than this many tokens.
    """

    tokenizer: Any
    max_seq_len: int

    def loglikelihood(self, requests: list[tuple[list[int], list[int]]]) -> list[float]:
        """Sum of log p(continuation token | everything before it), one float per ``(context, continuation)``.

        The context must not be empty. Sequences longer than ``max_seq_len`` lose context tokens on
        the left (see :func:`fit_request`).
        """
        ...

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop: list[str]) -> list[str]:
        """Greedy continuations of ``prompts``, decoded and cut before the first stop string."""
        ...


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def special_prefix(tokenizer: Any) -> list[int]:
    """The ids a tokenizer puts before the text when asked for special tokens (BOS for Llama, none for Qwen).

    Found by encoding a probe both ways, so it works for any tokenizer without knowing its config.
    """
    probe = "Answer"
    plain, full = encode(tokenizer, probe), list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def encode_context(tokenizer: Any, context: str) -> list[int]:
    """The model input for ``context``: the tokenizer's special prefix, then the text."""
    return special_prefix(tokenizer) + encode(tokenizer, context)


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids, split the way the whole string tokenizes.

    ``context + continuation`` is encoded once and cut after the context's tokens, so a merge
    across the boundary is not double counted (the rule of EleutherAI's lm-evaluation-harness).
    A space ending the context moves to the continuation first, as BPE vocabularies attach
    spaces to the following word.
    """
    trailing = len(context) - len(context.rstrip(" "))
    if trailing:
        context, continuation = context[:-trailing], context[-trailing:] + continuation
    prefix = special_prefix(tokenizer)
    whole = encode(tokenizer, context + continuation)
    context_ids = encode(tokenizer, context)
    return prefix + whole[: len(context_ids)], whole[len(context_ids) :]


def fit_request(context: Sequence[int], continuation: Sequence[int], max_seq_len: int) -> tuple[list[int], int]:
    """The sequence to score for one request and how many of its last tokens are the continuation.

    Args:
        context: context ids (not empty).
        continuation: continuation ids (not empty).
        max_seq_len: longest sequence the model sees; context tokens are dropped on the left to fit,
            and a continuation longer than ``max_seq_len - 1`` keeps only its last tokens scored.

    Returns:
        ``(sequence, n)``: score log p(sequence[t] | sequence[:t]) for the last ``n`` positions.

    Raises:
        ValueError: an empty context or continuation.
    """
    if not context or not continuation:
        raise ValueError("a log-likelihood request needs a non-empty context and continuation")
    sequence = (list(context) + list(continuation))[-max_seq_len:]
    return sequence, min(len(continuation), len(sequence) - 1)


def fit_prompt(prompt: Sequence[int], max_new_tokens: int, max_seq_len: int) -> list[int]:
    """``prompt`` without the left tokens that would not leave room for ``max_new_tokens``.

    Raises:
        ValueError: ``max_new_tokens`` leaves no room for a prompt.
    """
    room = max_seq_len - max_new_tokens
    if room < 1:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in a window of "
            f"{max_seq_len} tokens; lower --max-new-tokens or raise --max-seq-len"
        )
    return list(prompt)[-room:]


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    cut = len(text)
    for marker in stop:
        if marker:
            found = text.find(marker)
            if found != -1:
                cut = min(cut, found)
    return text[:cut]


def eos_token_ids(tokenizer: Any, *more: Any) -> tuple[int, ...]:
    """The tokenizer's EOS id and any further ids or lists of ids (a generation config's), deduplicated, in order."""
    ids: list[int] = []
    for value in (getattr(tokenizer, "eos_token_id", None), *more):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def stop_strings(tokenizer: Any, stop: Sequence[str], eos_ids: Sequence[int]) -> list[str]:
    """``stop`` plus the text of every EOS token, which ends a decoded generation too."""
    texts = [tokenizer.decode([i]) for i in eos_ids]
    return list(stop) + [t for t in texts if t and t not in stop]


def model_max_seq_len(config: Any, requested: int | None) -> int:
    """The evaluation window: ``requested``, else the model's position limit capped at :data:`DEFAULT_MAX_SEQ_LEN`.

    Raises:
        ValueError: ``requested`` is below 2 or beyond the model's position limit.
    """
    limit = getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
    if requested is None:
        return min(limit, DEFAULT_MAX_SEQ_LEN)
    if requested < 2 or requested > limit:
        raise ValueError(
            f"--max-seq-len {requested} must be between 2 and the model's max_position_embeddings ({limit})"
        )
    return requested


def _batches(order: list[int], size: int) -> list[list[int]]:
    return [order[i : i + size] for i in range(0, len(order), size)]


class TransformersLM:
    """The reference path: a ``transformers`` causal LM called directly.

    Log-likelihoods come from one forward pass per batch (right padding, attention mask);
    requests that feed the model the same tokens share one forward (the four answer letters of
    a multiple-choice question). Generations come from ``model.generate(do_sample=False)``.

    Args:
        model: an ``AutoModelForCausalLM`` in eval mode.
        tokenizer: its tokenizer.
        batch_size: sequences per forward or ``generate`` call.
        max_seq_len: evaluation window (default: :func:`model_max_seq_len`).
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 8, max_seq_len: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"--evaluation-batch-size must be at least 1, got {batch_size}")
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self.max_seq_len = model_max_seq_len(model.config, max_seq_len)
        self.device = next(model.parameters()).device
        generation_config = getattr(model, "generation_config", None)
        #: ids that end a generation: the tokenizer's EOS and the checkpoint's generation config's.
        self.eos_token_ids = eos_token_ids(tokenizer, getattr(generation_config, "eos_token_id", None))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_token_ids or [0])[0]
        self.pad_id = int(pad)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        tokenizer: Any = None,
        dtype: torch.dtype | None = None,
        batch_size: int = 8,
        max_seq_len: int | None = None,
    ) -> TransformersLM:
        """Load a local Hugging Face directory (nothing is downloaded) on the accelerator.

        Args:
            path: directory with config.json and the weights.
            tokenizer: a tokenizer to use instead of the one in ``path``.
            dtype: parameter dtype (default: the checkpoint's).
            batch_size: sequences per forward or ``generate`` call.
            max_seq_len: evaluation window.

        Raises:
            ValueError: ``path`` is not a Hugging Face model directory.
        """
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--load-dir {str(path)!r} holds no config.json; the transformers backend needs a "
                f"Hugging Face model directory (use --backend engine for a Megatron checkpoint)"
            )
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto", local_files_only=True)
        model.to(get_accelerator().device())
        return cls(model, tokenizer if tokenizer is not None else load_tokenizer(path), batch_size, max_seq_len)

    @torch.no_grad()
    def loglikelihood(self, requests: list[tuple[list[int], list[int]]]) -> list[float]:
        """See :meth:`LM.loglikelihood`."""
        fitted = [fit_request(ctx, cont, self.max_seq_len) for ctx, cont in requests]
        groups: dict[tuple[int, ...], list[int]] = {}
        for index, (sequence, _) in enumerate(fitted):
            groups.setdefault(tuple(sequence[:-1]), []).append(index)
        inputs = sorted(groups, key=len, reverse=True)  # similar lengths together: less padding
        out = [0.0] * len(requests)
        for batch in _batches(list(range(len(inputs))), self.batch_size):
            rows = [inputs[i] for i in batch]
            width = len(rows[0])
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, row in enumerate(rows):
                ids[r, : len(row)] = torch.tensor(row)
                mask[r, : len(row)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for r, row in enumerate(rows):
                # Normalise only the positions that are scored: [batch, length, vocab] fp32 would not fit for big vocabularies.
                first = min(len(fitted[i][0]) - 1 - fitted[i][1] for i in groups[row])
                logprobs = torch.log_softmax(logits[r, first : len(row)].float(), dim=-1).cpu()
                for index in groups[row]:
                    sequence, n = fitted[index]
                    positions = torch.arange(len(sequence) - 1 - n, len(sequence) - 1) - first
                    targets = torch.tensor(sequence[-n:])
                    out[index] = float(logprobs[positions, targets].sum())
        return out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop: list[str]) -> list[str]:
        """See :meth:`LM.generate`. Each batch stops early once every row has hit a stop string."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        stops = stop_strings(self.tokenizer, stop, self.eos_token_ids)
        fitted = [fit_prompt(p, max_new_tokens, self.max_seq_len) for p in prompts]
        order = sorted(range(len(fitted)), key=lambda i: len(fitted[i]), reverse=True)
        out = [""] * len(prompts)
        tokenizer = self.tokenizer

        class _StopOnStrings(StoppingCriteria):
            def __init__(self, start: int) -> None:
                self.start = start

            def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
                texts = tokenizer.batch_decode(input_ids[:, self.start :])
                done = [any(s in t for s in stops) for t in texts]
                return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

        for batch in _batches(order, self.batch_size):
            width = max(len(fitted[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):  # left padding: every row's next token sits in the last column
                ids[r, width - len(fitted[i]) :] = torch.tensor(fitted[i])
                mask[r, width - len(fitted[i]) :] = 1
            # Plain argmax: settings a checkpoint's generation config may carry (sampling, repetition
            # penalty, n-gram blocking, a minimum length) are overridden, as generate() would apply them.
            generated = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                temperature=None,
                top_p=None,
                top_k=None,
                repetition_penalty=1.0,
                no_repeat_ngram_size=0,
                min_length=0,
                eos_token_id=list(self.eos_token_ids),
                pad_token_id=self.pad_id,
                stopping_criteria=StoppingCriteriaList([_StopOnStrings(width)]),
            )
            for r, i in enumerate(batch):
                out[i] = truncate_at_stop(tokenizer.decode(generated[r, width:].tolist()), stops)
        return out


class EngineLM:
    """Our path: the suite's :class:`~mindspeed_llm.inference.InferenceEngine`.

    Log-likelihoods come from ``engine.score`` (per-token log-probs of whole sequences),
    generations from ``engine.generate`` with greedy :class:`SamplingParams` that stop on EOS;
    stop strings are applied to the decoded text, as the engine stops on token ids only.

    Args:
        engine: an ``InferenceEngine``.
        tokenizer: a tokenizer to use instead of ``engine.tokenizer``.
        batch_size: sequences per ``score`` or ``generate`` call.
        max_seq_len: evaluation window (default: the engine's model limit, see :func:`model_max_seq_len`).
    """

    def __init__(self, engine: Any, tokenizer: Any = None, batch_size: int = 8, max_seq_len: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"--evaluation-batch-size must be at least 1, got {batch_size}")
        self.engine, self.batch_size = engine, batch_size
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        if self.tokenizer is None:
            raise ValueError(
                "the checkpoint has no tokenizer files; pass --tokenizer-name-or-path (or --hf-cfg-dir with them)"
            )
        #: ids that end a generation: the engine's (from the generation config) and the tokenizer's EOS.
        self.eos_token_ids = eos_token_ids(self.tokenizer, list(getattr(engine, "eos_token_ids", ())))
        config = getattr(engine, "config", None) or getattr(getattr(engine, "model", None), "config", None)
        engine_limit = getattr(engine, "max_seq_len", None)
        self.max_seq_len = model_max_seq_len(config, max_seq_len)
        if engine_limit:
            self.max_seq_len = min(self.max_seq_len, int(engine_limit))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        tokenizer: Any = None,
        dtype: torch.dtype | None = None,
        batch_size: int = 8,
        max_seq_len: int | None = None,
        **engine_kwargs: Any,
    ) -> EngineLM:
        """Open a Hugging Face directory or Megatron checkpoint with ``InferenceEngine.from_pretrained``.

        Args:
            path: the checkpoint.
            tokenizer: a tokenizer to use instead of the engine's.
            dtype: parameter dtype (default: the checkpoint's).
            batch_size: sequences per call; also the engine's ``max_batch_size``.
            max_seq_len: evaluation window, passed to the engine.
            engine_kwargs: further ``from_pretrained`` arguments (``hf_cfg_dir`` for a Megatron checkpoint).
        """
        try:  # the engine backend only: the transformers backend never loads it
            from mindspeed_llm.inference import InferenceEngine
        except ModuleNotFoundError as err:
            if err.name != "mindspeed_llm.inference":
                raise
            raise ValueError(
                "--backend engine: this install has no mindspeed_llm.inference; "
                "pass --backend transformers for a Hugging Face directory"
            ) from err
        engine = InferenceEngine.from_pretrained(
            str(path), dtype=dtype, max_batch_size=batch_size, max_seq_len=max_seq_len, **engine_kwargs
        )
        return cls(engine, tokenizer, batch_size, max_seq_len)

    @torch.no_grad()
    def loglikelihood(self, requests: list[tuple[list[int], list[int]]]) -> list[float]:
        """See :meth:`LM.loglikelihood`."""
        fitted = [fit_request(ctx, cont, self.max_seq_len) for ctx, cont in requests]
        order = sorted(range(len(fitted)), key=lambda i: len(fitted[i][0]), reverse=True)
        out = [0.0] * len(requests)
        for batch in _batches(order, self.batch_size):
            scores = self.engine.score([fitted[i][0] for i in batch])
            for i, token_logprobs in zip(batch, scores):
                out[i] = float(token_logprobs[-fitted[i][1] :].sum())
        return out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop: list[str]) -> list[str]:
        """See :meth:`LM.generate`."""
        stops = stop_strings(self.tokenizer, stop, self.eos_token_ids)
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=self.eos_token_ids
        )
        fitted = [fit_prompt(p, max_new_tokens, self.max_seq_len) for p in prompts]
        order = sorted(range(len(fitted)), key=lambda i: len(fitted[i]), reverse=True)
        out = [""] * len(prompts)
        for batch in _batches(order, self.batch_size):
            results = self.engine.generate([fitted[i] for i in batch], params)
            for i, result in zip(batch, results):
                out[i] = truncate_at_stop(self.tokenizer.decode(list(result.token_ids)), stops)
        return out
