"""Pretraining on megatron-core: typed recipes, the trainer and checkpoints (the launcher is the core's).

Importing this package imports neither megatron-core nor torch.distributed's process groups;
``mindspeed_llm.training.trainer.pretrain`` and ``mindspeed.launch.launch`` do the work
when called.
"""

from mindspeed_llm.training.config import PretrainConfig, load_pretrain_config

__all__ = ["PretrainConfig", "load_pretrain_config"]
