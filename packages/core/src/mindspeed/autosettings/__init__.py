"""``mindspeed auto-settings``: search of parallel layouts and memory settings with analytic models.

:func:`job_from_recipe` reads the job from a recipe's plain mapping, :func:`estimate_memory`
and :func:`estimate_step_time` predict one :class:`Layout`, :func:`search` ranks every layout
that fits. See ``docs/core/auto-settings.md``.
"""

from mindspeed.autosettings.layout import Layout
from mindspeed.autosettings.memory import MemoryEstimate, estimate_memory
from mindspeed.autosettings.spec import ClusterSpec, JobSpec, job_from_recipe, parse_device

# The search and the time model (mindspeed.autosettings.search, .steptime) import torch through
# mindspeed.metrics; they are imported from their modules.
__all__ = ["ClusterSpec", "JobSpec", "Layout", "MemoryEstimate", "estimate_memory", "job_from_recipe", "parse_device"]
