"""The ``vllm`` rollout engine: vLLM's offline ``LLM`` with sleep mode and in-place weight sync.

Written for the V1 engine of vLLM 0.11 and later (the range the ``vllm`` extra locks, through
0.3x); the public API it uses:

- ``vllm.LLM(model=..., tensor_parallel_size=, gpu_memory_utilization=, enable_sleep_mode=True,
  seed=, max_model_len=, max_num_seqs=, worker_extension_cls=, logprobs_mode="raw_logprobs")``;
- ``LLM.generate([TokensPrompt(prompt_token_ids=...)], [SamplingParams(...)], use_tqdm=False)``
  with ``logprobs=0`` (the sampled token's log-probability only) and ``detokenize=False``;
- ``LLM.sleep(level=1)`` (weights to host memory, KV cache dropped) and ``LLM.wake_up(tags=[...])``;
- ``LLM.collective_rpc("<method>", args=...)``: runs a method of :class:`WeightSyncExtension`
  (mixed into every worker through ``worker_extension_cls``) on all tensor-parallel workers,
  each of which calls its model's ``load_weights(weights=...)``: vLLM's own loader, which
  takes full Hugging Face-named tensors and keeps each worker's shard (fusing q/k/v and
  gate/up on the way). This is how vLLM's RLHF examples and verl / OpenRLHF / TRL update the
  weights in place; reaching ``llm.llm_engine.model_executor.driver_worker`` directly only
  works in-process with one worker, ``collective_rpc`` works with every executor;
- ``LLM.reset_prefix_cache()``: cached prefixes were computed with the old weights.

``logprobs_mode="raw_logprobs"`` pins the meaning of the returned log-probabilities to what the
built-in engine and the trainer compute: the log-softmax of the model's logits before
temperature, top-k and top-p.

On Ascend the same class runs with ``vllm-ascend`` installed next to ``torch-npu`` (the Ascend adapter): it registers
itself as a vLLM platform plugin, and ``LLM`` then runs on NPUs with no change here (sleep mode
needs a vllm-ascend build with it, see its sleep-mode guide). vLLM is imported only when the
engine is built; without it the error names the extra to install and the ``builtin`` engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed_llm.engine import SamplingParams
from mindspeed_rl.rollout.base import ROLLOUT_ENGINES, RolloutOutput, check_params

logger = get_logger(__name__)

#: Qualified name vLLM imports in each worker process (``worker_extension_cls``).
WORKER_EXTENSION = "mindspeed_rl.rollout.vllm.WeightSyncExtension"
#: Tensors per ``collective_rpc`` call are grouped up to this many bytes (bounds the message size).
WEIGHT_BUCKET_BYTES = 512 * 2**20
_TAGS = ("weights", "kv_cache")


def import_vllm() -> ModuleType:
    """The ``vllm`` module.

    Raises:
        ValueError: vLLM is not installed (naming the extra to install and the ``builtin`` engine).
    """
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise ValueError(
            "rollout.engine=vllm needs vLLM, which is not installed: run `uv sync --extra vllm` "
            "(or `pip install mindspeed-rl[vllm]`; on Ascend also install vllm-ascend next to torch-npu), "
            f"or set rollout.engine=builtin ({exc})"
        ) from exc


class WeightSyncExtension:
    """Methods vLLM mixes into every worker (``worker_extension_cls``), called through ``collective_rpc``.

    Runs inside vLLM's worker processes, where ``self`` is the worker (``self.model_runner``).
    """

    def mindspeed_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load full Hugging Face-named tensors through the model's own loader (it keeps this
        worker's tensor-parallel shard).

        Returns:
            How many parameters the loader reported loaded.
        """
        loaded = self.model_runner.model.load_weights(weights=iter(weights))  # type: ignore[attr-defined]
        return len(loaded) if loaded is not None else len(weights)


def to_vllm_params(vllm: ModuleType, params: SamplingParams) -> Any:
    """:class:`~mindspeed_llm.inference.SamplingParams` as ``vllm.SamplingParams``.

    One sample per request, the sampled token's log-probability (``logprobs=0``), no text.
    """
    return vllm.SamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_new_tokens,
        seed=params.seed,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=0,
        detokenize=False,
    )


def from_vllm_output(prompt: Sequence[int], output: Any) -> RolloutOutput:
    """A ``vllm.RequestOutput`` as a :data:`~mindspeed_rl.rollout.base.RolloutOutput`.

    Raises:
        RuntimeError: the output carries no log-probabilities.
    """
    completion = output.outputs[0]
    tokens = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) < len(tokens):
        raise RuntimeError(
            "vLLM returned no log-probability for some sampled tokens; the request must ask for logprobs=0"
        )
    logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
    finish = completion.finish_reason if completion.finish_reason in ("stop", "length") else "length"
    return RolloutOutput([int(t) for t in prompt], tokens, logprobs, finish)


def weight_buckets(
    state: Mapping[str, torch.Tensor], limit: int = WEIGHT_BUCKET_BYTES
) -> list[list[tuple[str, torch.Tensor]]]:
    """Host-memory copies of ``state`` grouped into lists of at most ``limit`` bytes (a bigger tensor alone).

    Host memory because the tensors cross into vLLM's worker processes by serialization.
    """
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor.detach().to("cpu")))
        size += nbytes
    return [b for b in buckets if b]


class VLLMRollout:
    """:class:`~mindspeed_rl.rollout.base.RolloutEngine` over ``vllm.LLM``.

    Args:
        llm: a ``vllm.LLM`` built with ``enable_sleep_mode=True`` and
            ``worker_extension_cls=WORKER_EXTENSION`` (see :meth:`from_pretrained`).
        vllm: the ``vllm`` module.
        sleep_level: 1 keeps the weights in host memory while asleep; 2 drops them (cheaper,
            when every sync sends the whole state).
    """

    def __init__(self, llm: Any, vllm: ModuleType, sleep_level: int = 1) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.llm, self.vllm, self.sleep_level = llm, vllm, sleep_level
        self._asleep: set[str] = set()
        self._stale_prefixes = False

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        max_num_seqs: int = 64,
        tp: int = 1,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        max_model_len: int | None = None,
        sleep_level: int = 1,
        **options: Any,
    ) -> VLLMRollout:
        """``vllm.LLM`` on a Hugging Face directory (see :func:`~mindspeed_rl.rollout.base.build_rollout`).

        Args:
            model_dir: the Hugging Face checkpoint.
            max_num_seqs: sequences vLLM schedules at once.
            tp: ``tensor_parallel_size``.
            gpu_memory_utilization: vLLM's share of device memory.
            seed: vLLM's seed (requests without their own seed draw from it).
            max_model_len: prompt plus response tokens (default: the model's).
            sleep_level: see the class.
            options: more ``vllm.LLM`` keywords (override the ones above).

        Raises:
            ValueError: vLLM is not installed.
        """
        vllm = import_vllm()
        kwargs: dict[str, Any] = dict(
            model=str(model_dir),
            tensor_parallel_size=tp,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=True,
            seed=seed,
            max_num_seqs=max_num_seqs,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="raw_logprobs",
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(options)
        logger.info("vLLM %s rollout engine on %s (tp=%d)", getattr(vllm, "__version__", "?"), model_dir, tp)
        return cls(vllm.LLM(**kwargs), vllm, sleep_level)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[RolloutOutput]:
        """One response per prompt; wakes a sleeping engine.

        Raises:
            ValueError: a params count that does not match the prompts.
        """
        params = check_params(prompt_ids, params)
        self._wake(_TAGS)
        if self._stale_prefixes:
            self.llm.reset_prefix_cache()
            self._stale_prefixes = False
        tokens_prompt = importlib.import_module("vllm.inputs").TokensPrompt
        prompts = [tokens_prompt(prompt_token_ids=[int(t) for t in ids]) for ids in prompt_ids]
        outputs = self.llm.generate(prompts, [to_vllm_params(self.vllm, p) for p in params], use_tqdm=False)
        return [from_vllm_output(ids, out) for ids, out in zip(prompt_ids, outputs)]

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load Hugging Face-named full tensors on every worker (weights woken first, the KV cache not)."""
        self._wake(("weights",))
        for bucket in weight_buckets(state):
            self.llm.collective_rpc("mindspeed_load_weights", args=(bucket,))
        self._stale_prefixes = True

    def sleep(self) -> None:
        """``LLM.sleep``: weights to host memory (level 1) or dropped (level 2), KV cache dropped."""
        if not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = set(_TAGS)

    def wake_up(self) -> None:
        """``LLM.wake_up`` of what sleeps."""
        self._wake(_TAGS)

    def _wake(self, tags: Sequence[str]) -> None:
        todo = [tag for tag in _TAGS if tag in tags and tag in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep.difference_update(todo)


@ROLLOUT_ENGINES.register("vllm")
def build_vllm(model_dir: str | Path, **settings: Any) -> VLLMRollout:
    """Registry factory of :class:`VLLMRollout` (keywords of :meth:`VLLMRollout.from_pretrained`)."""
    return VLLMRollout.from_pretrained(model_dir, **settings)
