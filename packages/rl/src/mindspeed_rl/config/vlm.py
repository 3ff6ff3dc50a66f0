"""The checks of a vision-language GRPO recipe (``actor.model_type: vlm``), after :meth:`GRPOConfig.check`.

The vision-language path runs as the launcher's ranks (``actor.dp`` x ``actor.ulysses_parallel_size``),
each with its actor, rollout engine and rewards co-located (no Ray workers): what needs more than that is
refused with the key and the fix.
"""

from __future__ import annotations

from pathlib import Path

from mindspeed.config import ConfigError
from mindspeed_rl.config.sections import RecipeSections


def check_vlm(config: RecipeSections) -> None:
    """Raise ``ConfigError`` naming the first key a vision-language run does not support."""
    a, r, d = config.actor, config.rollout, config.data
    if not (Path(str(a.model)) / "config.json").is_file():
        raise ConfigError(
            f"actor.model={a.model!r} has no config.json; give the Hugging Face directory of a vision-language "
            "model (Qwen2.5-VL, Qwen3-VL), or demo"
        )
    unsupported = {
        "actor.tp": a.tp != 1,
        "actor.pp": a.pp != 1,
        "actor.lora": a.lora.enabled,
        "rollout.engine": r.engine != "builtin",
        "rollout.colocate": not r.colocate,
        "rollout.tools": bool(r.tools),
        "buffer.mode": config.buffer.mode != "sync",
        "algorithm.dynamic_sampling": config.algorithm.dynamic_sampling,
    }
    for key, wrong in unsupported.items():
        if wrong:
            raise ConfigError(
                f"{key}: actor.model_type=vlm runs data- and sequence-parallel ranks only (co-located built-in "
                f"engine, sync, single-turn); leave {key} at its default"
            )
    if not 0 < d.image_min_pixels <= d.image_max_pixels:
        raise ConfigError(
            f"need 0 < data.image_min_pixels <= data.image_max_pixels (got {d.image_min_pixels} and "
            f"{d.image_max_pixels})"
        )
