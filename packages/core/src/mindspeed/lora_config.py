"""The ``lora`` recipe section of the suites that fine-tune with LoRA (LLM, MM): which linears get
low-rank factors, their rank and scale, and where the adapter is written.

:class:`LoraConfig` holds the keys both suites have and checks them next to the fields; a suite extends
it by subclassing (its own keys, defaults and target names in the subclass), never by copying it. The
LLM suite adapts megatron linears (and adds QLoRA and a Megatron adapter checkpoint); the MM suite
adapts the linears of a transformers / diffusers model through peft (and picks the model's parts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from mindspeed.config import ConfigError


@dataclass
class LoraConfig:
    """LoRA fine-tuning; off while ``target_modules`` is empty.

    Attributes:
        target_modules: names of the linears to adapt (each suite's names: see its subclass).
            Everything else is frozen.
        r: rank of the factors.
        alpha: the update is scaled by ``alpha / r``.
        dropout: dropout on the LoRA input while training.
        save_peft: at the end, write the adapter here in the format its library loads (see the
            suite's subclass).
    """

    #: The keys that write or change an adapter, so need ``target_modules`` (a subclass adds its own).
    NEEDS_TARGETS: ClassVar[tuple[str, ...]] = ("save_peft",)
    #: The targets a "needs LoRA" message suggests.
    EXAMPLE_TARGETS: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj")

    target_modules: list[str] = field(default_factory=list)
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    save_peft: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on."""
        return bool(self.target_modules)

    def check(self) -> None:
        """Check the factors' settings, then that no key asks for an adapter while LoRA is off.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        self.check_factors()
        if self.enabled:
            return
        for key in self.NEEDS_TARGETS:
            if getattr(self, key):
                raise ConfigError(
                    f"lora.{key} needs LoRA: set lora.target_modules (e.g. [{', '.join(self.EXAMPLE_TARGETS)}])"
                )

    def check_factors(self) -> None:
        """Check ``r``, ``alpha`` and ``dropout`` (raises ``ConfigError`` naming the key and the fix)."""
        if self.r < 1:
            raise ConfigError(f"lora.r={self.r} must be at least 1")
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be positive (the update is scaled by alpha / r)")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
