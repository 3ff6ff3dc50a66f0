"""The LLM suite's engine API: what other suites (``mindspeed_rl``) build and run LLMs with.

Everything here is defined elsewhere in ``mindspeed_llm`` and re-exported under one documented
name, so a suite that builds on the LLM suite imports this module only, never the suite's
training internals (``tests/sanity/test_engine_api.py`` enforces it for ``mindspeed_rl``).
A name added here is a promise to keep it; add one only for a need of another suite.

Build (the one build sequence, shared with the LLM ``Trainer``: :mod:`mindspeed_llm.training.build`):
    :class:`BuildSpec`, :class:`Engine`, :func:`build_engine`, :func:`model_facts`,
    :func:`seed_everything`, :func:`uses_dualpipev`, :func:`build_transformer_config`, :func:`default_groups`,
    :func:`padded_vocab_size`, :func:`attach_score_head` (a scalar head in place of the output
    layer: a reward model's score head, a critic's value head).
Recipe sections the builders take:
    :class:`ParallelConfig`, :class:`OptimizerConfig`, :class:`SchedulerConfig`,
    :class:`CheckpointConfig`, :class:`PretrainConfig` (the recipe a checkpoint records).
Hugging Face models and weights (the bridges):
    :func:`hf_model_shape`, :func:`read_hf_shape`, :func:`load_hf_weights`, :func:`unwrap`,
    :class:`ParallelLayout`, :func:`plan_conversion`, :func:`megatron_to_hf`, :func:`merge_tensors`.
A training step:
    :class:`PackSettings`, :func:`pack_microbatch`, :func:`packed_seq_params`,
    :func:`guarded_step`, :func:`scheduler_state`, :func:`schedule_settings`.
Checkpoints of a built model that holds its pieces (``chunks``, ``optimizer``, ``scheduler``, ``config``):
    :func:`save_model_checkpoint`, :func:`load_model_checkpoint`.
LoRA (an RL actor whose adapters train; :mod:`mindspeed_llm.training.lora`):
    :class:`LLMLoraConfig` (the ``lora`` section of ``mindspeed-llm sft``), :class:`LoraSettings`,
    :func:`apply_lora`, :func:`lora_layers`, :func:`lora_disabled` (the base model within a block),
    :func:`lora_delta_weight` (``B @ A * alpha / r`` of a layer), :func:`export_peft` (a PEFT
    adapter directory for the Hugging Face base).
Inference (the built-in engine):
    :class:`InferenceEngine`, :class:`SamplingParams`, :class:`GenerationOutput`,
    :class:`GenerationSession` (requests submitted while others decode: multi-turn rollouts).

Importing this module imports neither megatron-core nor torch.distributed's process groups
(the builders import megatron when called).
"""

from __future__ import annotations

from mindspeed_llm.bridges import ParallelLayout, megatron_to_hf, merge_tensors, plan_conversion
from mindspeed_llm.inference import GenerationOutput, GenerationSession, InferenceEngine, SamplingParams
from mindspeed_llm.training.build import BuildSpec, Engine, build_engine, model_facts, seed_everything, uses_dualpipev
from mindspeed_llm.training.checkpoint import load_model_checkpoint, save_model_checkpoint
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.finetune_data import PackSettings, pack_microbatch
from mindspeed_llm.training.hf import hf_model_shape, load_hf_weights, read_hf_shape
from mindspeed_llm.training.lora import LoraSettings, apply_lora, lora_delta_weight, lora_disabled, lora_layers
from mindspeed_llm.training.lora_io import export_peft
from mindspeed_llm.training.model import build_transformer_config, default_groups, padded_vocab_size, unwrap
from mindspeed_llm.training.optim import guarded_step, schedule_settings, scheduler_state
from mindspeed_llm.training.reward import attach_score_head
from mindspeed_llm.training.sections import (
    CheckpointConfig,
    LLMLoraConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
)
from mindspeed_llm.training.steps import packed_seq_params

__all__ = [
    # build
    "BuildSpec",
    "Engine",
    "build_engine",
    "model_facts",
    "seed_everything",
    "uses_dualpipev",
    "build_transformer_config",
    "default_groups",
    "padded_vocab_size",
    "attach_score_head",
    # recipe sections
    "ParallelConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "CheckpointConfig",
    "PretrainConfig",
    # Hugging Face models and weights
    "hf_model_shape",
    "read_hf_shape",
    "load_hf_weights",
    "unwrap",
    "ParallelLayout",
    "plan_conversion",
    "megatron_to_hf",
    "merge_tensors",
    # a training step
    "PackSettings",
    "pack_microbatch",
    "packed_seq_params",
    "guarded_step",
    "scheduler_state",
    "schedule_settings",
    # checkpoints
    "save_model_checkpoint",
    "load_model_checkpoint",
    # LoRA
    "LLMLoraConfig",
    "LoraSettings",
    "apply_lora",
    "lora_layers",
    "lora_disabled",
    "lora_delta_weight",
    "export_peft",
    # inference
    "InferenceEngine",
    "SamplingParams",
    "GenerationOutput",
    "GenerationSession",
]
