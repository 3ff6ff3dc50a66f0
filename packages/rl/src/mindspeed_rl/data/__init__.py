"""RL prompt data: local files, prompt formats, batching, and the generated arithmetic set."""

from __future__ import annotations

from mindspeed_rl.data.arithmetic import DEMO_TEST, DEMO_TRAIN, generate_arithmetic, regenerate_demo, write_jsonl
from mindspeed_rl.data.prompts import (
    DEFAULT_MAP_KEYS,
    PromptFormat,
    PromptRecord,
    PromptSampler,
    encode_prompts,
    load_prompts,
    read_records,
    resolve_data_path,
)

__all__ = [
    "DEFAULT_MAP_KEYS",
    "DEMO_TEST",
    "DEMO_TRAIN",
    "PromptFormat",
    "PromptRecord",
    "PromptSampler",
    "encode_prompts",
    "generate_arithmetic",
    "load_prompts",
    "read_records",
    "regenerate_demo",
    "resolve_data_path",
    "write_jsonl",
]
