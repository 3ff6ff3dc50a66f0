"""Measurements shared by benchmarks, tests and run reports (peak memory, ...)."""

from mindspeed.metrics.memory import METHODS, PeakMemory, StorageTracker, measure_peak_memory, resolve_method

__all__ = ["METHODS", "PeakMemory", "StorageTracker", "measure_peak_memory", "resolve_method"]
