"""``mindspeed-mm convert``: DCP training checkpoints <-> Hugging Face directories, LoRA <-> PEFT adapters, merges.

:func:`mindspeed_mm.convert.convert.convert` runs one; :class:`mindspeed_mm.convert.config.ConvertConfig`
holds its options (importing this package imports neither).
"""
