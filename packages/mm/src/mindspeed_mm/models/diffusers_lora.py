"""diffusers LoRA files of a diffusion transformer: what ``pipe.load_lora_weights(DIR)`` reads, read strictly and written.

A directory holding ``pytorch_lora_weights.safetensors`` (diffusers' ``LORA_WEIGHT_NAME_SAFE``),
laid out as diffusers' ``save_lora_weights`` writes it for Wan and FLUX pipelines
(``WanLoraLoaderMixin``, ``FluxLoraLoaderMixin``):

- tensors ``transformer.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``
  (the transformer's module names behind the pipeline component's name);
- the safetensors metadata ``{"format": "pt", "lora_adapter_metadata": JSON}``, the JSON being
  peft's ``LoraConfig.to_dict()`` with every key behind ``transformer.``: the loader builds its
  ``LoraConfig`` from it, so ``lora_alpha`` (the scale ``alpha / r``) survives. Without metadata
  diffusers takes ``lora_alpha = r``, and so does :func:`read_diffusers_lora`.

Only plain LoRA on the transformer is accepted (as :mod:`~mindspeed_mm.models.peft_io`): text
encoder factors, DoRA, LoRA biases, per-module ranks or alphas, and other trainers' key layouts
(``diffusion_model.``, ``lora_unet_``: diffusers converts those when it loads them) are errors
naming the tensor or setting.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from mindspeed_mm.models.lora import AdapterSettings, adapter_config
from mindspeed_mm.models.peft_io import Adapter, check_plain

#: The file ``load_lora_weights`` looks for in a directory.
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
#: The pipeline component the factors belong to.
COMPONENT = "transformer"
#: The safetensors metadata key of the adapter's config (diffusers' ``LORA_ADAPTER_METADATA_KEY``).
METADATA_KEY = "lora_adapter_metadata"
_NAME = re.compile(rf"^{COMPONENT}\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def is_diffusers_lora(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a diffusers LoRA file."""
    return (Path(path) / LORA_WEIGHTS).is_file()


def write_diffusers_lora(adapter: Adapter, directory: str | Path) -> Path:
    """Write ``adapter`` into ``directory`` (which exists) as diffusers' ``save_lora_weights`` does; returns the file."""
    from safetensors.torch import save_file

    tensors = {}
    for module, (a, b) in sorted(adapter.factors.items()):
        tensors[f"{COMPONENT}.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{COMPONENT}.{module}.lora_B.weight"] = b.contiguous()
    config = adapter_config(adapter.settings, None)
    config.pop("base_model_name_or_path", None)
    metadata = {f"{COMPONENT}.{key}": value for key, value in config.items()}
    target = Path(directory) / LORA_WEIGHTS
    save_file(tensors, target, metadata={"format": "pt", METADATA_KEY: json.dumps(metadata, indent=2, sort_keys=True)})
    return target


def read_diffusers_lora(path: str | Path) -> Adapter:
    """Read the diffusers LoRA of the directory (or file) ``path``.

    Raises:
        ValueError: no such file, unreadable, a tensor that is not a transformer LoRA factor, a
            factor without its pair, a rank other than the metadata's, or a setting other than plain LoRA.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    file = path / LORA_WEIGHTS if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--load-dir {path} has no {LORA_WEIGHTS}; is it a diffusers LoRA directory?")
    try:
        with safe_open(str(file), framework="pt") as handle:
            raw = (handle.metadata() or {}).get(METADATA_KEY)
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is unreadable ({err}); is it complete?") from None
    config = {}
    if raw:
        try:
            packed = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}: its {METADATA_KEY} is not valid JSON ({err})") from None
        others = sorted(key for key in packed if not key.startswith(f"{COMPONENT}."))
        if others:
            raise ValueError(f"{file}: LoRA settings of other components ({', '.join(others[:3])}); transformer only")
        config = {key[len(COMPONENT) + 1 :]: value for key, value in packed.items()}
        check_plain(config, f"{file} ({METADATA_KEY})")
    unknown = sorted(name for name in tensors if not _NAME.match(name))
    if unknown:
        raise ValueError(
            f"{file}: {len(unknown)} tensors are not LoRA factors of the transformer "
            f"({COMPONENT}.<module>.lora_A/B.weight): {', '.join(unknown[:5])}"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        pairs.setdefault(match.group("module"), {})[match.group("which")] = tensor
    if not pairs:
        raise ValueError(f"{file} holds no LoRA factors")
    ranks = {int(pair["A"].shape[0]) for pair in pairs.values() if "A" in pair}
    r = int(config.get("r") or (next(iter(ranks)) if len(ranks) == 1 else 0))
    factors = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{file}: {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(
                f"{file}: {module} has factors {tuple(a.shape)} and {tuple(b.shape)}, not one rank r={r} for all"
            )
        factors[module] = (a, b)
    settings = AdapterSettings(
        r,
        float(config.get("lora_alpha") or r),
        config.get("target_modules") or sorted(factors),
        float(config.get("lora_dropout") or 0.0),
    )
    return Adapter(settings, factors)
