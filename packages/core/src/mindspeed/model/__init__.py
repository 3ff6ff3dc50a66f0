"""The one model description (:class:`ModelShape`) the core's generic pieces and the suites share."""

from mindspeed.model.shape import ModelShape

__all__ = ["ModelShape"]
