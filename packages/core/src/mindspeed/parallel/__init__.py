"""Parallelism as plain torch.distributed algorithms; process groups are passed as values.

- :mod:`mindspeed.parallel.context_parallel`: Ulysses, ring and hybrid context parallelism.
"""
