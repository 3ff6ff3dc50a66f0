"""The ``checkpoint`` recipe section every suite composes: where checkpoints go, how many stay,
whether a run resumes, the Hugging Face export and which learning-rate schedule wins on resume.

One :class:`CheckpointConfig` for the LLM, MM and RL suites (RL takes it as it is); a suite whose
checkpoints do more extends it by subclassing (the LLM suite adds ``load`` / ``load_hf`` /
``finetune`` ..., MM adds ``export_ema``; both add ``save_at_end``), never by copying its fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mindspeed.checkpointing.schedule import check_scheduler_flags
from mindspeed.config import ConfigError


@dataclass
class CheckpointConfig:
    """Checkpoints of the run (the trainer's own layout, marked complete last) and the HF export.

    Attributes:
        save: directory of the checkpoints (default: none are written).
        interval: save every this many steps (default: only at the end).
        keep_last: keep only this many newest complete checkpoints (default: all); damaged
            ones are neither counted nor deleted.
        resume: continue from the newest complete checkpoint in ``save`` (damaged newer ones are
            skipped with a warning); a ``save`` holding checkpoints but no complete one is an
            error unless this is false.
        save_hf: write the final model as a Hugging Face directory here.
        save_hf_dtype: dtype of the ``save_hf`` tensors: auto (the dtype the model was trained
            in), float32, bfloat16 or float16; a transformers export's config.json always says the
            dtype written.
        override_scheduler: on resume, when the recipe's learning-rate schedule (peak and final
            learning rate, warmup, decay style and length, weight decay) differs from the
            checkpoint's, the recipe wins: the schedule goes on from the resumed step with the
            recipe's values (megatron's ``--override-opt_param-scheduler``). A difference with
            neither this nor ``use_checkpoint_scheduler`` is an error that lists it.
        use_checkpoint_scheduler: on resume, the checkpoint's learning-rate schedule wins over a
            different one in the recipe (megatron's ``--use-checkpoint-opt_param-scheduler``).
    """

    save: str | None = None
    interval: int | None = None
    keep_last: int | None = None
    resume: bool = True
    save_hf: str | None = None
    save_hf_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    override_scheduler: bool = False
    use_checkpoint_scheduler: bool = False

    def check(self) -> None:
        """Check the section's values.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        for key in ("interval", "keep_last"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"checkpoint.{key}={value} must be at least 1 (or unset)")
        check_scheduler_flags(self.override_scheduler, self.use_checkpoint_scheduler)
