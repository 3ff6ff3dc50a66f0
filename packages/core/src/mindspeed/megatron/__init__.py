"""The megatron-core adaptor: ``adapt()`` makes megatron-core run on any accelerator.

Importing this package does nothing (megatron-core itself is imported by ``adapt()``).
"""

from mindspeed.megatron.active import current_report
from mindspeed.megatron.adaptor import AdaptReport, adapt, adapted, enter_thread, fast_path, unadapt

__all__ = ["AdaptReport", "adapt", "adapted", "current_report", "enter_thread", "fast_path", "unadapt"]
