"""``actor.lora``: LoRA RL, the ``lora`` section of ``mindspeed-llm sft`` under the actor.

Only the adapters train; the reference policy is the actor with its adapters switched off (no
second model), the rollout engine receives the merged weights ``W + (alpha / r) B A``, and at the
end ``save_peft`` writes the adapter for the Hugging Face base (``checkpoint.save_hf`` writes the
merged model). docs/rl/lora.md has the recipe and its measured memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed.config import ConfigError, recipe_section
from mindspeed_llm.engine import LLMLoraConfig


@recipe_section(
    name="LoraConfig",
    keys=("target_modules", "r", "alpha", "dropout", "qlora", "qlora_all_linears", "save_peft", "save_adapter"),
)
@dataclass
class RLLoraConfig(LLMLoraConfig):
    """The LLM suite's LoRA section (same keys, defaults and checks) for the RL actor; off while
    ``target_modules`` is empty. ``qlora`` and ``save_adapter`` are not supported by RL yet."""

    def check(self) -> None:
        """The LLM suite's checks, with ``actor.`` in front of the key; then what RL cannot do yet.

        Raises:
            ConfigError: naming the key and the fix.
        """
        try:
            super().check()
        except ConfigError as err:
            raise ConfigError(f"actor.{err}") from err
        if self.qlora or self.qlora_all_linears:
            raise ConfigError("actor.lora.qlora is not supported by RL yet; unset it (LoRA on the full-precision base)")
        if self.save_adapter:
            raise ConfigError(
                "actor.lora.save_adapter (a Megatron LoRA checkpoint) is not supported by RL; "
                "use actor.lora.save_peft (a PEFT adapter) or checkpoint.save_hf (the merged model)"
            )
