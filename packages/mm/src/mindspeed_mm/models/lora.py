"""LoRA on a transformers model through peft, with the model's own module names kept.

peft's ``inject_adapter_in_model`` replaces each targeted ``nn.Linear`` (``q_proj``, ...) by a
LoRA layer holding the frozen ``base_layer`` and the trainable ``lora_A`` / ``lora_B``, without
wrapping the model in a ``PeftModel``, so FSDP2 plans, freezing and checkpoints see the same
names as without LoRA (plus ``.base_layer``). The targets are found by name inside the parts
``lora.parts`` names (by default the language model of a vision-language model, the whole of a
diffusion transformer), as one regular expression that peft matches against full module names.
``lora.target_modules: [default]`` stands for a diffusion transformer family's own targets
(:attr:`~mindspeed_mm.models.dit.DiTFamily.lora_targets`: its attention projections).

Names of one adapted linear ``P`` (e.g. ``model.language_model.layers.0.self_attn.q_proj``):

| where | base weight | factors |
| --- | --- | --- |
| the trained model | ``P.base_layer.weight`` | ``P.lora_A.default.weight``, ``P.lora_B.default.weight`` |
| its DCP checkpoints | (the base model's, ``model.path``) | ``P.lora_A.default.weight``, ``P.lora_B.default.weight`` |
| a PEFT adapter (``adapter_model.safetensors``) | (the base model's) | ``base_model.model.P.lora_A.weight``, ``...lora_B.weight`` |
| a merged Hugging Face model | ``P.weight`` + (alpha / r) B A | none |
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed_mm.config import MMLoraConfig
from mindspeed_mm.models.dit import DiTFamily
from mindspeed_mm.models.family import VLMFamily

logger = get_logger(__name__)

#: peft's adapter name inside the trained model.
ADAPTER = "default"
#: The prefix of every tensor name in a PEFT adapter file.
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: ``lora.target_modules`` entry that stands for the family's default targets (diffusion transformers).
DEFAULT_TARGETS = "default"
_FACTOR = re.compile(rf"^(?P<module>.+)\.lora_(?P<which>[AB])\.{ADAPTER}\.weight$")


def default_parts(family: VLMFamily | DiTFamily) -> list[str]:
    """Where the targets are looked for when ``lora.parts`` is empty: a VLM's language model, else everywhere."""
    return ["language_model"] if "language_model" in family.parts else []


def scope_prefixes(lora: MMLoraConfig, family: VLMFamily | DiTFamily) -> list[str]:
    """The module-name prefixes ``lora.parts`` stands for (a part's prefixes, or the entry itself; none: everywhere)."""
    return [prefix for part in lora.parts or default_parts(family) for prefix in family.parts.get(part, (part,))]


def target_names(lora: MMLoraConfig, family: VLMFamily | DiTFamily) -> list[str]:
    """``lora.target_modules`` with ``default`` replaced by the family's own targets.

    Raises:
        ValueError: ``default`` for a family that declares none.
    """
    names = []
    for name in lora.target_modules:
        if name == DEFAULT_TARGETS:
            defaults = getattr(family, "lora_targets", ())
            if not defaults:
                raise ValueError(
                    f"lora.target_modules: {family.architecture} has no default targets; name the linears "
                    "(e.g. [q_proj, k_proj, v_proj, o_proj])"
                )
            names.extend(n for n in defaults if n not in names)
        elif name not in names:
            names.append(name)
    return names


def target_regex(lora: MMLoraConfig, family: VLMFamily | DiTFamily) -> str:
    """The regular expression of the module names to adapt (peft ``fullmatch``es it against each name)."""
    names = "|".join(re.escape(name) for name in target_names(lora, family))
    prefixes = scope_prefixes(lora, family)
    if not prefixes:
        return rf"(?:.*\.)?(?:{names})"
    return rf"(?:{'|'.join(re.escape(prefix) for prefix in prefixes)})\.(?:.*\.)?(?:{names})"


def peft_config(lora: MMLoraConfig, target_modules: str | list[str]) -> Any:
    """peft's ``LoraConfig`` of the recipe's ``lora`` section over ``target_modules`` (a regex or a list)."""
    import peft

    return peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target_modules)


def apply_lora(model: torch.nn.Module, lora: MMLoraConfig, family: VLMFamily | DiTFamily) -> list[str]:
    """Freeze ``model`` and add LoRA factors to the target modules; returns the adapted module names.

    Raises:
        ValueError: no module matches ``lora.target_modules`` inside ``lora.parts``.
    """
    from peft import inject_adapter_in_model

    modules = dict(model.named_modules())
    for part, prefixes in ((part, family.parts.get(part, (part,))) for part in lora.parts):
        if not any(prefix in modules for prefix in prefixes):
            raise ValueError(
                f"lora.parts: {part!r} is not a part of {family.architecture} ({', '.join(family.parts)}) "
                f"or a module name such as {next(n for n in modules if n.count('.') == 1)!r}"
            )
    model.requires_grad_(False)
    try:
        inject_adapter_in_model(peft_config(lora, target_regex(lora, family)), model, adapter_name=ADAPTER)
    except ValueError:
        leaves = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in modules.items()
                if isinstance(module, torch.nn.Linear) and not name.rsplit(".", 1)[-1].isdigit()
            }
        )
        raise ValueError(
            f"lora.target_modules={target_names(lora, family)}: no linear of {family.architecture} inside "
            f"lora.parts={lora.parts or default_parts(family)} has that name; its linears are named "
            f"{', '.join(leaves)}"
        ) from None
    adapted = adapted_modules(dict(model.named_parameters()))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        "LoRA r=%d alpha=%g on %d linears (%s in %s): %d trainable parameters of %d (%.3f%%)",
        lora.r,
        lora.alpha,
        len(adapted),
        ", ".join(target_names(lora, family)),
        ", ".join(lora.parts or default_parts(family)) or "the whole model",
        trainable,
        sum(p.numel() for p in model.parameters()),
        100 * trainable / max(1, sum(p.numel() for p in model.parameters())),
    )
    return adapted


def adapted_modules(names: dict[str, Any] | list[str]) -> list[str]:
    """The names of the adapted linears among the tensor names of a trained model (or its checkpoint)."""
    return sorted({m.group("module") for name in names if (m := _FACTOR.match(name)) and m.group("which") == "A"})


def is_factor(name: str) -> bool:
    """Whether ``name`` is a LoRA factor of a trained model (``P.lora_A.default.weight``, ``P.lora_B...``)."""
    return _FACTOR.match(name) is not None


def factor_names(module: str) -> tuple[str, str]:
    """The names of the LoRA factors of ``module`` in the trained model: ``(lora_A, lora_B)``."""
    return f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * b @ a``, computed in fp32, in ``weight``'s dtype (what peft's ``merge`` gives)."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def peft_adapter_state(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA factors of a full state dict under PEFT's file names."""
    out = {}
    for name, value in full.items():
        match = _FACTOR.match(name)
        if match:
            out[f"{PEFT_PREFIX}{match.group('module')}.lora_{match.group('which')}.weight"] = value.contiguous()
    return out


def merged_state(full: dict[str, torch.Tensor], lora: MMLoraConfig) -> dict[str, torch.Tensor]:
    """The model's own state dict with each LoRA update folded into its base weight."""
    scale = lora.alpha / lora.r
    out = {}
    for name, value in full.items():
        if _FACTOR.match(name):
            continue
        if ".base_layer." in name:
            prefix, leaf = name.rsplit(".base_layer.", 1)
            if leaf == "weight":
                value = merge_weight(
                    value, full[f"{prefix}.lora_A.{ADAPTER}.weight"], full[f"{prefix}.lora_B.{ADAPTER}.weight"], scale
                )
            name = f"{prefix}.{leaf}"
        out[name] = value
    return out


def recorded_lora_alpha(checkpoint: Path, given: float | None) -> float | None:
    """``given``, else the alpha a LoRA run recorded in ``adapter_config.json`` in the step or its save folder.

    Raises:
        ValueError: both are there and differ, or the recorded file is damaged.
    """
    recorded = next(
        (p / ADAPTER_CONFIG for p in (checkpoint, checkpoint.parent) if (p / ADAPTER_CONFIG).is_file()), None
    )
    if recorded is None:
        return given
    try:
        alpha = float(json.loads(recorded.read_text())["lora_alpha"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ValueError(f"{recorded} is damaged (no lora_alpha); pass --lora-alpha") from None
    if given is not None and given != alpha:
        raise ValueError(
            f"--lora-alpha {given} differs from the run's lora_alpha {alpha} ({recorded}); leave --lora-alpha out"
        )
    return alpha


@dataclass(frozen=True)
class AdapterSettings:
    """What ``adapter_config.json`` records and a merge needs.

    Attributes:
        r: rank.
        alpha: scale numerator (the update is ``alpha / r * B A``).
        target_modules: peft's ``target_modules`` (a regex string or a list of names).
        dropout: LoRA dropout (training only).
    """

    r: int
    alpha: float
    target_modules: str | list[str]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.r


def adapter_config(settings: AdapterSettings, base: str | Path | None) -> dict[str, Any]:
    """The ``adapter_config.json`` content peft writes for these settings."""
    import peft

    config = peft.LoraConfig(
        r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=settings.target_modules
    ).to_dict()
    config["base_model_name_or_path"] = str(base) if base is not None else None
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}


def write_adapter_config(
    lora: MMLoraConfig, family: VLMFamily | DiTFamily, base: str | Path, directory: str | Path
) -> Path:
    """Write the run's ``adapter_config.json`` into ``directory`` (atomically); returns its path.

    A LoRA run writes it next to its DCP checkpoints too, so ``mindspeed-mm convert`` knows alpha.
    """
    settings = AdapterSettings(lora.r, lora.alpha, target_regex(lora, family), lora.dropout)
    target = Path(directory) / ADAPTER_CONFIG
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(adapter_config(settings, base), indent=2, default=str) + "\n")
    os.replace(tmp, target)
    return target


def write_peft_adapter(
    full: dict[str, torch.Tensor], lora: MMLoraConfig, family: VLMFamily, base: str | Path, target: str | Path
) -> Path:
    """Write the adapter of a trained model's full state dict as a PEFT directory, atomically.

    ``adapter_model.safetensors`` holds the factors under PEFT's names, ``adapter_config.json``
    the recipe's settings (targets as the regular expression the run used).
    """
    from safetensors.torch import save_file

    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(peft_adapter_state(full), tmp / ADAPTER_WEIGHTS)
    write_adapter_config(lora, family, base, tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    logger.info("saved the PEFT adapter to %s", target)
    return target
