"""``mindspeed``: the suite's inference engine as an lm-evaluation-harness model.

:class:`MindSpeedLM` is an lm-eval ``TemplateLM``: lm-eval builds the requests (prompts, few-shot
examples, chat templates) and tokenizes context/continuation pairs with its own rules; this class
answers them with :class:`~mindspeed_llm.evaluation.lm.EngineLM`'s engine on a Hugging Face
directory or a Megatron checkpoint. Truncation follows lm-eval's ``hf`` model (``HFLM``) exactly,
so the same weights give the same numbers under ``--model mindspeed`` and ``--model hf``:

- log-likelihood: the last ``max_length + 1`` tokens of context + continuation, scored at the
  continuation's positions; ``is_greedy`` is whether every continuation token is the argmax;
- rolling log-likelihood: lm-eval's disjoint windows of ``max_length`` tokens after the prefix
  token (BOS, else EOS);
- generation: the context's last ``max_length - max_gen_toks`` tokens, greedy unless the task asks
  for sampling, decoded without special tokens and cut at the stop strings and EOS.

Model arguments (``--model_args``) use lm-eval's names: ``pretrained`` (the checkpoint),
``tokenizer``, ``batch_size``, ``max_length``, ``max_gen_toks``, ``dtype``, ``hf_cfg_dir``
(Megatron checkpoints without their ``hf_config`` folder); ``device`` is the accelerator's.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from mindspeed.log import get_logger
from mindspeed_llm.evaluation.harness import import_lm_eval
from mindspeed_llm.evaluation.lm import EngineLM, encode, fit_request, special_prefix
from mindspeed_llm.inference import SamplingParams
from mindspeed_llm.tokenizer import load_tokenizer

import_lm_eval()  # before any lm_eval import: keeps the environment unchanged (see there)

from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import model_registry  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text  # noqa: E402

logger = get_logger(__name__)

#: ``--model`` name under which :func:`register_harness_model` puts :class:`MindSpeedLM`.
MODEL_NAME = "mindspeed"
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _batch_size(value: Any) -> int:
    """lm-eval's ``batch_size`` (an int, a digit string or ``auto``/``auto:N``) as a count; ``auto`` means 8."""
    if value is None or str(value).startswith("auto"):
        return 8
    if not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"model_args batch_size={value!r}: expected a positive count or 'auto'")
    return int(value)


class MindSpeedLM(TemplateLM):
    """The suite's inference engine behind lm-eval's three request types (see the module docstring).

    Args:
        pretrained: Hugging Face directory or Megatron checkpoint.
        tokenizer: tokenizer directory instead of the checkpoint's.
        batch_size: sequences per engine call (``auto``: 8).
        max_length: longest sequence lm-eval windows and truncates to (default: the model's limit, at most 4096).
        max_gen_toks: generation budget when a task sets none (lm-eval's default 256).
        dtype: auto, float32, bfloat16 or float16.
        hf_cfg_dir: Hugging Face config (and tokenizer) directory of a Megatron checkpoint.
        kwargs: lm-eval's other arguments (``device``, ``max_batch_size``, ``trust_remote_code`` ...), ignored.
    """

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        batch_size: int | str | None = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        dtype: str = "auto",
        hf_cfg_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if str(dtype) not in DTYPES:
            raise ValueError(f"model_args dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        ignored = sorted(k for k, v in kwargs.items() if v is not None and k not in ("device", "max_batch_size"))
        if ignored:
            logger.warning("model_args %s do not apply to the mindspeed model; ignored", ", ".join(ignored))
        self.batch_size_per_call = _batch_size(batch_size)
        extra = {"hf_cfg_dir": hf_cfg_dir} if hf_cfg_dir else {}
        self.lm = EngineLM.from_pretrained(
            pretrained,
            load_tokenizer(tokenizer) if tokenizer else None,
            DTYPES[str(dtype)],
            self.batch_size_per_call,
            None,
            **extra,
        )
        self.engine, self.tokenizer = self.lm.engine, self.lm.tokenizer
        self._max_length = int(max_length) if max_length is not None else self.lm.max_seq_len
        if self._max_length < 2:
            raise ValueError(f"model_args max_length={max_length}: must be at least 2")
        self.max_gen_toks = int(max_gen_toks)
        self.pretrained = str(pretrained)
        self._prefix = special_prefix(self.tokenizer)

    # -- what lm-eval reads ----------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        """The EOS id (lm-eval's end-of-text)."""
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """Context of an empty-context request and of the first rolling window: BOS, else EOS (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """The window lm-eval truncates and rolls to."""
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        """Key of lm-eval's request cache for chat-templated prompts."""
        return str(getattr(self.tokenizer, "name_or_path", self.pretrained)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Ids of ``string``: the tokenizer's special prefix (BOS where it adds one), then the text.

        ``add_special_tokens=False`` or a string that already starts with the prefix's text (a chat
        template that writes BOS) gets no prefix, as HFLM does.
        """
        prefix = self._prefix
        if add_special_tokens is False or (prefix and string.startswith(self.tokenizer.decode(prefix))):
            prefix = []
        return prefix + encode(self.tokenizer, string)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``tokens``."""
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over ``chat_history`` (lm-eval's ``--apply_chat_template``)."""
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # -- the three request types -----------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(sum log p(continuation), all argmax)`` per ``(key, context ids, continuation ids)``, batched."""
        fitted = [fit_request(ctx, cont, self.max_length + 1) for _, ctx, cont in requests]
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        size = self.batch_size_per_call
        # One-token continuations of the same input (the answer letters of a question) share one forward.
        shared: dict[tuple[int, ...], list[int]] = {}
        for i, (sequence, n) in enumerate(fitted):
            if n == 1:
                shared.setdefault(tuple(sequence[:-1]), []).append(i)
        prefixes = sorted(shared, key=len, reverse=True)
        rest = sorted((i for i in range(len(fitted)) if fitted[i][1] != 1), key=lambda i: -len(fitted[i][0]))
        with tqdm(total=len(requests), disable=disable_tqdm, desc="mindspeed loglikelihood") as bar:
            for first in range(0, len(prefixes), size):
                batch = prefixes[first : first + size]
                for prefix, logprobs in zip(batch, self.engine.next_token_logprobs(batch)):
                    best = int(logprobs.argmax())
                    for i in shared[prefix]:
                        token = fitted[i][0][-1]
                        out[i] = (float(logprobs[token]), best == token)
                    bar.update(len(shared[prefix]))
            for first in range(0, len(rest), size):
                batch = rest[first : first + size]
                scores = self.engine.score([fitted[i][0] for i in batch], return_greedy=True)
                for i, (logprobs, greedy) in zip(batch, scores):
                    n = fitted[i][1]
                    out[i] = (float(logprobs[-n:].sum()), bool(greedy[-n:].all()))
                bar.update(len(batch))
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string, over lm-eval's disjoint windows of ``max_length`` tokens."""
        from lm_eval import utils

        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, *window))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each ``(context, gen_kwargs)``, batched among requests with equal settings."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(index)
        out = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="mindspeed generate_until")
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            budget = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - budget
            if room < 1:
                raise ValueError(
                    f"max_gen_toks {budget} leaves no room for a prompt in max_length {self.max_length}; "
                    f"raise max_length or lower max_gen_toks"
                )
            sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
            params = SamplingParams(
                max_new_tokens=budget,
                temperature=float(kwargs.get("temperature") or 0.0) if sampled else 0.0,
                top_k=int(kwargs.get("top_k") or 0) if sampled else 0,
                top_p=float(kwargs.get("top_p") or 1.0) if sampled else 1.0,
                stop_token_ids=self.lm.eos_token_ids,
            )
            prompts = {i: self.tok_encode(requests[i].args[0])[-room:] for i in indices}
            order = sorted(indices, key=lambda i: len(prompts[i]), reverse=True)
            for first in range(0, len(order), self.batch_size_per_call):
                batch = order[first : first + self.batch_size_per_call]
                results = self.engine.generate([prompts[i] for i in batch], params)
                for i, result in zip(batch, results):
                    out[i] = postprocess_generated_text(self.tok_decode(list(result.token_ids)), until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
                bar.update(len(batch))
        bar.close()
        return out


def register_harness_model() -> None:
    """Make ``mindspeed`` an lm-eval ``--model`` name (idempotent; lm-eval itself is untouched otherwise)."""
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MindSpeedLM)
