"""PEFT LoRA adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``), read strictly and written.

Only what a merge reproduces exactly is accepted: plain LoRA on linears, one rank and one alpha
(no ``rank_pattern`` / ``alpha_pattern``), no DoRA, no rsLoRA, no LoRA bias, no
``modules_to_save``. Anything else is an error naming the setting.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mindspeed_mm.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, AdapterSettings, adapter_config

_NAME = re.compile(rf"^{re.escape(PEFT_PREFIX)}(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
#: adapter_config.json settings a plain LoRA leaves off (false, null or empty).
_NOT_PLAIN = (
    "use_dora",
    "use_rslora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
)


@dataclass
class Adapter:
    """A LoRA adapter: its settings and its factors by module name.

    Attributes:
        settings: rank, alpha, targets.
        factors: module name -> ``(A [r, in], B [out, r])``.
    """

    settings: AdapterSettings
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


def check_plain(config: dict, where: str) -> None:
    """Refuse an adapter config (peft's ``LoraConfig`` as a dict) other than plain LoRA.

    Raises:
        ValueError: naming the first setting a merge would not reproduce.
    """
    for key in _NOT_PLAIN:
        if config.get(key):
            raise ValueError(
                f"{where}: {key}={config[key]!r} is not supported (plain LoRA only; "
                "merge it with peft's merge_and_unload instead)"
            )


def read_peft_adapter(path: str | Path) -> Adapter:
    """Read a PEFT adapter directory.

    Raises:
        ValueError: missing files, a setting other than plain LoRA, a tensor that is not a LoRA
            factor, a factor without its pair, or a rank other than the config's.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise ValueError(f"--load-dir {path} has no {name}; is it a PEFT adapter directory?")
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / ADAPTER_CONFIG} is not valid JSON ({err})") from None
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path / ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r}; only LORA adapters convert")
    check_plain(config, str(path / ADAPTER_CONFIG))
    try:
        tensors = load_file(path / ADAPTER_WEIGHTS)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path / ADAPTER_WEIGHTS} is unreadable ({err}); is it complete?") from None
    unknown = sorted(name for name in tensors if not _NAME.match(name))
    if unknown:
        raise ValueError(
            f"{path / ADAPTER_WEIGHTS}: {len(unknown)} tensors are not LoRA factors "
            f"({PEFT_PREFIX}<module>.lora_A/B.weight): {', '.join(unknown[:5])}"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        pairs.setdefault(match.group("module"), {})[match.group("which")] = tensor
    r = int(config.get("r", 0))
    factors = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{path / ADAPTER_WEIGHTS}: {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(
                f"{path / ADAPTER_WEIGHTS}: {module} has factors {tuple(a.shape)} and {tuple(b.shape)}, "
                f"not rank r={r} of adapter_config.json"
            )
        factors[module] = (a, b)
    if not factors:
        raise ValueError(f"{path / ADAPTER_WEIGHTS} holds no LoRA factors")
    settings = AdapterSettings(
        r,
        float(config.get("lora_alpha", r)),
        config.get("target_modules") or sorted(factors),
        float(config.get("lora_dropout", 0.0)),
    )
    return Adapter(settings, factors)


def write_peft_adapter_dir(adapter: Adapter, directory: Path, base: str | Path | None) -> None:
    """Write ``adapter`` into ``directory`` as peft's ``save_pretrained`` lays it out."""
    from safetensors.torch import save_file

    tensors = {}
    for module, (a, b) in adapter.factors.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, directory / ADAPTER_WEIGHTS)
    (directory / ADAPTER_CONFIG).write_text(
        json.dumps(adapter_config(adapter.settings, base), indent=2, default=str) + "\n"
    )
