"""Checkpoint formats and the ``convert-ckpt`` conversion (see :mod:`.convert`)."""
