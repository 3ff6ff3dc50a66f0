"""The built-in inference engine: batched generation with a KV cache and continuous batching.

One loop serves every request: while slots are free, waiting requests are admitted and their
prompts prefilled together (right-padded rows, causal attention, keys and values written into
their cache slots); then every running request advances by one token in a single batched
decode step. Requests admitted together with the same prompt
(the ``n`` samples of an RL group) share its prefill: the prompt runs through the model once and
its keys and values are copied into the other requests' slots. A request that stops frees its
slot at once (the last running slot moves into it, so running requests always occupy slots ``0 .. n-1``) and the next waiting request takes
it on the following iteration. The same engine scores sequences (log-probabilities for RL) and
takes new weights as Hugging Face-named tensors (RL weight sync through the bridges).
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.device.cuda_shim import redirect_suspended
from mindspeed.log import get_logger
from mindspeed_llm.bridges import Bridge, bridge_for_architectures
from mindspeed_llm.inference.batching import ContinuousBatching, Request, Stream
from mindspeed_llm.inference.cache import CausalStep, KVCache
from mindspeed_llm.inference.compiled import CompiledDecode
from mindspeed_llm.inference.loading import open_checkpoint, parse_dtype
from mindspeed_llm.inference.model import Decoder
from mindspeed_llm.inference.sampling import Sampler, SamplingParams
from mindspeed_llm.inference.spec import build_spec, stop_token_ids
from mindspeed_llm.inference.weights import WeightLoader

logger = get_logger(__name__)


def _outside_redirect(fn: Callable[..., Any]) -> Callable[..., Any]:
    # The engine never names a CUDA device: megatron's device redirect (when adapt() ran in
    # this process, e.g. in an RL actor worker) would only add ~10 us to each of its torch
    # calls, 2.6x the decode time of a tiny model.
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with redirect_suspended():
            return fn(*args, **kwargs)

    return wrapper


#: Positions per logits call in :meth:`InferenceEngine.score` (bounds the ``[tokens, vocab]`` buffer).
_SCORE_CHUNK = 1024


@dataclass
class GenerationOutput:
    """What one request produced.

    Attributes:
        prompt_token_ids: the prompt.
        token_ids: the generated tokens (a stop token, when one ended the request, included).
        logprobs: per generated token, its log-probability under the model's distribution (the
            log-softmax of the logits before temperature, top-k and top-p).
        finish_reason: ``"stop"`` (a stop token) or ``"length"`` (``max_new_tokens`` or the
            engine's ``max_seq_len`` reached).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class InferenceEngine(ContinuousBatching):
    """Generation, scoring and weight updates on one device.

    Args:
        model: the decoder.
        bridge: the family's bridge (maps Hugging Face tensor names in :meth:`load_weights`).
        config: the transformers config.
        tokenizer: the transformers tokenizer, or ``None``.
        eos_token_ids: ids that end a request unless ``ignore_eos``.
        max_batch_size: requests decoded at once (cache slots).
        max_seq_len: prompt plus generated tokens per request (default: the model's
            ``max_position_embeddings``); the cache is allocated for what a call needs, up to this.
        max_prefill_tokens: padded prompt tokens prefilled in one forward (at least one request).
        prefix_sharing: requests admitted together with the same prompt (an RL group's samples)
            prefill it once; the others get a copy of its keys and values (the tokens, log-probs
            and sampling streams are those of the unshared path).
        compile: run the decode step under ``torch.compile`` (:mod:`.compiled`: one graph per batch
            bucket, the prefill eager); ``True`` or a ``mindspeed.compile.MODES`` key. Dense models only.
    """

    def __init__(
        self,
        model: Decoder,
        bridge: Bridge,
        config: Any,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        max_prefill_tokens: int = 8192,
        prefix_sharing: bool = True,
        compile: bool | str = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.model, self.bridge, self.config, self.tokenizer = model, bridge, config, tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_seq_len = int(max_seq_len or model.spec.shape.max_position_embeddings)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {self.max_seq_len}")
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_sharing = prefix_sharing
        self.sampler = Sampler(model.device)
        self.cache: KVCache | None = None
        self._loader: WeightLoader | None = None
        self.compiled = CompiledDecode(model, max_batch_size, compile) if compile else None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype | None = None,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        *,
        hf_cfg_dir: str | Path | None = None,
        model_type_hf: str | None = None,
        device: str | torch.device | None = None,
        kernels: dict[str, str] | None = None,
        compile: bool | str = False,
    ) -> InferenceEngine:
        """An engine on the weights of a Hugging Face directory or a Megatron checkpoint.

        Args:
            path: Hugging Face directory (config.json + safetensors) or Megatron checkpoint
                (per-rank ``mp_rank_*`` or ``torch_dist``, any TP/PP/EP/VPP layout).
            dtype: compute dtype (``None``: the weights' dtype).
            max_batch_size: requests decoded at once.
            max_seq_len: tokens per request (default: the model's ``max_position_embeddings``).
            hf_cfg_dir: directory with config.json and tokenizer files (Megatron checkpoints
                without the ``hf_config`` folder convert-ckpt leaves; tokenizer for any).
            model_type_hf: family override (``llama2``, ``mistral``, ``qwen25``, ``qwen3``, ``mixtral``, ``qwen3-moe``).
            device: where to run (default: the current accelerator, the CPU without one).
            kernels: registry implementation per op (default ``auto``).
            compile: compile the decode step (see :class:`InferenceEngine`).

        Raises:
            ValueError: a missing or unreadable checkpoint, an unsupported family or dtype.
        """
        started = time.perf_counter()
        opened = open_checkpoint(path, hf_cfg_dir, model_type_hf)
        spec = build_spec(opened.bridge, opened.shape, opened.config)
        torch_dtype = parse_dtype(dtype) or getattr(torch, opened.shape.params_dtype)
        model = Decoder(spec, torch_dtype, torch.device(device) if device else get_accelerator().device(), kernels)
        with torch.no_grad():
            opened.read_into(model.tensors())
        tokenizer = opened.tokenizer()
        eos = stop_token_ids(opened.generation_config(), opened.config, tokenizer)
        logger.info(
            "inference engine: %s -> %s %s on %s in %.2f s",
            opened.description,
            spec.family,
            str(torch_dtype).removeprefix("torch."),
            model.device,
            time.perf_counter() - started,
        )
        return cls(model, opened.bridge, opened.config, tokenizer, eos, max_batch_size, max_seq_len, compile=compile)

    @classmethod
    def from_config(
        cls,
        config: Any,
        dtype: str | torch.dtype = torch.float32,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | None = None,
        device: str | torch.device | None = None,
        kernels: dict[str, str] | None = None,
        compile: bool | str = False,
    ) -> InferenceEngine:
        """An engine with zero weights for a transformers config; fill it with :meth:`load_weights`.

        This is how a rollout engine starts when its weights come from a trainer rather than a file.

        Args:
            config: a transformers ``PretrainedConfig`` (its ``architectures`` pick the bridge).
            dtype: compute dtype.
            max_batch_size: requests decoded at once.
            max_seq_len: tokens per request (default: the model's ``max_position_embeddings``).
            tokenizer: the tokenizer to expose as :attr:`tokenizer`.
            eos_token_ids: stop ids (default: the config's, else the tokenizer's).
            device: where to run (default: the current accelerator).
            kernels: registry implementation per op (default ``auto``).
            compile: compile the decode step (see :class:`InferenceEngine`).

        Raises:
            ValueError: an unsupported architecture or configuration.
        """
        bridge = bridge_for_architectures(getattr(config, "architectures", None))
        shape = bridge.shape_from_hf(config.to_dict())
        model = Decoder(
            build_spec(bridge, shape, config),
            parse_dtype(dtype),
            torch.device(device) if device else get_accelerator().device(),
            kernels,
        )
        eos = tuple(eos_token_ids) if eos_token_ids is not None else stop_token_ids(None, config, tokenizer)
        return cls(model, bridge, config, tokenizer, eos, max_batch_size, max_seq_len, compile=compile)

    # -- generation -------------------------------------------------------------------------

    @_outside_redirect
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        stream: Stream | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt, ``max_batch_size`` at a time with continuous batching.

        Args:
            prompts: token ids of each prompt.
            params: settings for all prompts, or one per prompt (default greedy, 64 tokens).
            stream: called as ``stream(prompt_index, token_id)`` as each token is produced.

        Returns:
            One output per prompt, in order.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, or a prompt that
                leaves no room in ``max_seq_len``.
        """
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(
                f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt"
            )
        requests = [self._request(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, per_prompt))]
        if not requests:
            return []
        longest = max(len(r.prompt) + r.limit - 1 for r in requests)
        # Compiled: every slot, so that the cache's strides (which the graphs are specialised on) stay put.
        self._ensure_cache(self.max_batch_size if self.compiled else min(len(requests), self.max_batch_size), longest)
        waiting, running = collections.deque(requests), []
        while waiting or running:
            if waiting and len(running) < self.max_batch_size:
                admitted = self._admit(waiting, self.max_batch_size - len(running))
                self._prefill(admitted, start=len(running), stream=stream)
                running += admitted
                self._retire(running)
            if running:
                self._decode(running, stream)
                self._retire(running)
        return [GenerationOutput(list(r.prompt), r.tokens, r.logprobs, r.finish_reason or "length") for r in requests]

    def _request(self, index: int, prompt: Sequence[int], params: SamplingParams) -> Request:
        tokens = [int(t) for t in prompt]
        vocab = self.model.spec.vocab_size
        if not tokens:
            raise ValueError(f"prompt {index} is empty; give at least one token")
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.max_seq_len:
            raise ValueError(
                f"prompt {index} has {len(tokens)} tokens, which leaves no room for generation within "
                f"max_seq_len={self.max_seq_len}; shorten it or raise --max-seq-len"
            )
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        limit = min(params.max_new_tokens, self.max_seq_len - len(tokens))
        return Request(index, tokens, params, self.sampler.generator(params), frozenset(stops), limit)

    def free_cache(self) -> None:
        """Release the KV cache (e.g. before training steps share the device); the next call allocates
        one again."""
        self.cache = None

    # -- scoring and reference forward -------------------------------------------------------

    @_outside_redirect
    @torch.inference_mode()
    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits ``[n, vocab]`` of one sequence from a full causal forward without a cache.

        This is the reference path: the KV-cache generation must agree with it.
        """
        token_ids = list(token_ids)
        model, device = self.model, self.model.device
        step = CausalStep(model.attention, model.spec.windows, model.scale, 1, len(token_ids))
        return model.logits(
            model.hidden(torch.tensor(token_ids, device=device), torch.arange(len(token_ids), device=device), step)
        )

    @_outside_redirect
    @torch.inference_mode()
    def score(self, sequences: Sequence[Sequence[int]], return_greedy: bool = False) -> list[Any]:
        """Log-probability of every token given the ones before it, batched.

        Args:
            sequences: token ids of each sequence.
            return_greedy: also say, per token, whether it is the model's argmax there
                (lm-evaluation-harness's ``is_greedy``).

        Returns:
            Per sequence of ``n`` tokens, a float32 CPU tensor of ``n - 1`` values: ``log p(x_t | x_<t)``
            for ``t = 1 .. n-1``; with ``return_greedy``, a pair of it and a bool tensor of the same length.
        """
        model = self.model
        out: list[Any] = [torch.zeros(0)] * len(sequences)
        for group, tokens, hidden in self._batched_hidden(sequences):
            for row, i in enumerate(group):
                n = len(sequences[i])
                pieces, greedy = [], []
                for begin in range(0, n - 1, _SCORE_CHUNK):
                    end = min(n - 1, begin + _SCORE_CHUNK)
                    logprobs = model.logits(hidden[row, begin:end]).log_softmax(dim=-1)
                    targets = tokens[row, begin + 1 : end + 1]
                    pieces.append(logprobs.gather(1, targets[:, None])[:, 0])
                    if return_greedy:
                        greedy.append(logprobs.argmax(dim=-1) == targets)
                scores = torch.cat(pieces).cpu() if pieces else torch.zeros(0)
                if return_greedy:
                    out[i] = (scores, torch.cat(greedy).cpu() if greedy else torch.zeros(0, dtype=torch.bool))
                else:
                    out[i] = scores
        return out

    @_outside_redirect
    @torch.inference_mode()
    def next_token_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Log-probabilities of every vocabulary token after each (non-empty) sequence, batched.

        One forward serves every candidate continuation token of a prompt (the four answer letters
        of a multiple-choice question).

        Returns:
            Per sequence, a float32 CPU tensor of the vocabulary's size.
        """
        out: list[torch.Tensor] = [torch.zeros(0)] * len(sequences)
        for group, _, hidden in self._batched_hidden(sequences):
            last = torch.stack([hidden[row, len(sequences[i]) - 1] for row, i in enumerate(group)])
            logprobs = self.model.logits(last).float().log_softmax(dim=-1).cpu()
            for row, i in enumerate(group):
                out[i] = logprobs[row]
        return out

    def _batched_hidden(self, sequences: Sequence[Sequence[int]]) -> Any:
        """``(indices, tokens, hidden)`` per batch of at most ``max_batch_size`` sequences of similar length.

        Sequences are right-padded with token 0; causal attention keeps padding out of every real position.
        """
        model, device = self.model, self.model.device
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths pad less
        for first in range(0, len(order), self.max_batch_size):
            group = order[first : first + self.max_batch_size]
            seq = max(1, max(len(sequences[i]) for i in group))
            tokens = torch.zeros(len(group), seq, dtype=torch.long)
            for row, i in enumerate(group):
                tokens[row, : len(sequences[i])] = torch.tensor(list(sequences[i]), dtype=torch.long)
            tokens = tokens.to(device)
            step = CausalStep(model.attention, model.spec.windows, model.scale, len(group), seq)
            positions = torch.arange(seq, device=device).repeat(len(group))
            yield group, tokens, model.hidden(tokens.view(-1), positions, step).view(len(group), seq, -1)

    # -- weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Replace weights from Hugging Face-named tensors (RL weight sync), through the family's bridge.

        Any subset of the model's tensors may be given, in one call or spread over several
        (buckets); a fused weight (q/k/v, gate/up) changes once all of its parts have arrived.

        Args:
            hf_state: Hugging Face name -> tensor (any dtype or device; converted on copy).

        Raises:
            ValueError: a name the model does not have, or a shape that does not match.
        """
        if self._loader is None:
            self._loader = WeightLoader(self.bridge, self.model.spec.shape, self.model.tensors())
        self._loader.load(hf_state)
        if self.compiled is not None:
            self.compiled.weights_changed()
