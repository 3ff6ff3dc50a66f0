"""The model as megatron-core sees it: the core's :class:`~mindspeed.model.ModelShape`.

The one description of a model lives in the core (:mod:`mindspeed.model.shape`) so that the
core's generic pieces (the ``TransformerConfig`` builder, FLOPs, the tiny test models) derive
from it too; bridges translate Hugging Face configs to and from it.
"""

from mindspeed.model.shape import ModelShape

__all__ = ["ModelShape"]
