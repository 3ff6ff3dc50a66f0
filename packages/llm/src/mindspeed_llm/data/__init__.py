"""Data preprocessing for the LLM suite: raw records to Megatron indexed datasets.

``preprocess_data(PreprocessConfig(...))`` is the Python API of ``mindspeed-llm
preprocess-data``; handlers are registered by name in :data:`HANDLERS`, prompt types in
:data:`PROMPT_TYPES`.
"""

from mindspeed_llm.data.handlers import HANDLERS, DatasetHandler
from mindspeed_llm.data.preprocess import PreprocessConfig, PreprocessReport, preprocess_data
from mindspeed_llm.data.templates import IGNORE_INDEX, PROMPT_TYPES, BadRecordError, PromptTemplate

__all__ = [
    "HANDLERS",
    "IGNORE_INDEX",
    "PROMPT_TYPES",
    "BadRecordError",
    "DatasetHandler",
    "PreprocessConfig",
    "PreprocessReport",
    "PromptTemplate",
    "preprocess_data",
]
