"""LoRA policies for diffusion RL (Flow-GRPO / DanceGRPO): peft factors on the diffusers transformer, as
``mindspeed-mm train``'s ``lora`` section puts them (:func:`mindspeed_mm.models.lora.apply_lora`: the base
frozen, ``lora_A`` / ``lora_B`` on the named linears, the model's own module names kept).

- the trained parameters are the factors only (:func:`trainable_parameters`, what AdamW gets);
- the KL reference is the same model with its adapters switched off (:class:`AdapterOffPolicy`): no second
  copy of the transformer is kept (a full-weight run deep-copies it: one more transformer in memory);
- the run's state holds the factors (:func:`adapter_state`), which :func:`load_adapter_state` puts back
  over the base weights of ``load_dir``;
- :func:`merged_transformer` folds ``(alpha / r) B A`` into each base weight and returns a plain diffusers
  model of the family's class (``save_pretrained`` writes a directory diffusers loads).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mindspeed_mm.config import MMLoraConfig
from mindspeed_mm.models.dit import DiTFamily
from mindspeed_mm.models.lora import apply_lora, is_factor, merged_state
from mindspeed_rl.models.dit_policy import DiTPolicy


def policy_lora_config(rank: int, alpha: float, target_modules: list[str] | tuple[str, ...]) -> MMLoraConfig:
    """The MM suite's ``lora`` section for ``rank`` / ``alpha`` / ``target_modules`` (``default``: the family's).

    Raises:
        ValueError: no targets, or a rank / alpha out of range (the MM check's message).
    """
    if not target_modules:
        raise ValueError("lora_target_modules is empty: name the linears (e.g. [default] or [to_q, to_k, to_v])")
    config = MMLoraConfig(target_modules=list(target_modules), r=int(rank), alpha=float(alpha))
    try:
        config.check()
    except Exception as err:  # ConfigError: re-worded with this config's key names
        raise ValueError(str(err).replace("lora.r", "lora_rank").replace("lora.alpha", "lora_alpha")) from None
    return config


def apply_policy_lora(model: torch.nn.Module, family: DiTFamily, lora: MMLoraConfig) -> list[str]:
    """Freeze ``model`` and add the factors (:func:`~mindspeed_mm.models.lora.apply_lora`); the adapted linears."""
    return apply_lora(model, lora, family)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that require grad (with LoRA: the factors only)."""
    return [p for p in model.parameters() if p.requires_grad]


def _tuner_layers(model: torch.nn.Module) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its base inside the block (peft's ``enable_adapters(False)`` on every LoRA layer).

    peft's switch also clears the factors' ``requires_grad``; it is restored on leaving.
    """
    layers = _tuner_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA layers: adapters_disabled needs a model with LoRA (apply_policy_lora)")
    flags = {id(p): p.requires_grad for p in model.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p in model.parameters():
            p.requires_grad_(flags[id(p)])


class AdapterOffPolicy(DiTPolicy):
    """The base of a LoRA policy (its adapters off) as the KL reference: the same module, no copy."""

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, prompts: Any) -> torch.Tensor:
        with adapters_disabled(self.model):
            return super().velocity(latents, timestep, prompts)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA factors of ``model`` by their names in its state dict (``...lora_A.default.weight``)."""
    return {name: value for name, value in model.state_dict().items() if is_factor(name)}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put :func:`adapter_state`'s factors back into ``model`` (the same LoRA layers over its base).

    Raises:
        ValueError: the names differ from the model's factors (another rank or targets).
    """
    mine = adapter_state(model)
    if set(mine) != set(state):
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise ValueError(
            f"the state's LoRA factors do not match the model's (missing {missing[:3]}, unexpected {extra[:3]}): "
            "resume with the lora_target_modules the run was started with"
        )
    for name, value in mine.items():
        if value.shape != state[name].shape:
            raise ValueError(
                f"LoRA factor {name}: state {tuple(state[name].shape)}, model {tuple(value.shape)}; "
                "resume with the run's lora_rank"
            )
    model.load_state_dict(state, strict=False)


def merged_transformer(model: torch.nn.Module, family: DiTFamily, lora: MMLoraConfig) -> Any:
    """A plain diffusers model of ``family``'s class whose weights are ``model``'s base plus ``(alpha / r) B A``."""
    state = merged_state({k: v.detach() for k, v in model.state_dict().items()}, lora)
    cls = family.load_class()
    merged = cls.from_config(model.config)
    merged.load_state_dict(state, strict=True)
    dtype = next(model.parameters()).dtype
    return merged if next(merged.parameters()).dtype == dtype else merged.to(dtype)
