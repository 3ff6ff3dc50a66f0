"""One module per model family; each registers its bridge when imported.

:mod:`mindspeed_llm.bridges` imports every module of this package, in name order: adding a
family is one module here (its :class:`~mindspeed_llm.bridges.base.Bridge`: config-key table,
parameter rules, capabilities) plus its tiny config in :mod:`mindspeed_llm.testing.tiny_models`.
"""
