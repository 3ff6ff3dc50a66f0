"""``mindspeed-mm convert``: DCP training checkpoints, Hugging Face directories and PEFT adapters, one into another.

| ``--load-format`` -> ``--save-format`` | what is written |
| --- | --- |
| ``dcp`` -> ``hf`` | the checkpoint's model as a Hugging Face directory (a LoRA run's factors merged into ``--base-dir``) |
| ``hf`` -> ``dcp`` | the weights as the ``model`` entries of a DCP checkpoint (module names) |
| ``dcp`` -> ``peft`` | the LoRA factors of a LoRA run's checkpoint as a PEFT adapter |
| ``peft`` -> ``dcp`` | base model + adapter as a LoRA model's ``model`` entries (``base_layer`` + factors) |
| ``peft`` -> ``hf`` | base model + adapter merged (``W + alpha / r B A``) |
| ``dcp`` -> ``lora`` | the LoRA factors of a diffusion transformer's LoRA run as a diffusers LoRA file |
| ``lora`` -> ``dcp`` / ``hf`` | as ``peft``, from a diffusers LoRA (``pytorch_lora_weights.safetensors``) |

``hf`` is a Hugging Face model directory or a diffusers transformer directory (``config.json`` with
``_class_name``; its ``diffusion_pytorch_model.safetensors`` holds the module names as they are,
and is written as diffusers' ``save_pretrained`` writes it). A checkpoint of a ``train.ema`` run
gives the moving averages of its trained weights unless ``--no-ema``.

Every conversion is checked whole before anything is written: each tensor on one side must
match one on the other (by transformers' own renaming between module and hub names, see
:mod:`mindspeed_mm.convert.names`), with the same shape; an unmatched tensor is an error naming
it. Hugging Face outputs stream: tensors are read (a DCP batch or one mapped safetensors
tensor at a time) and written at their planned offsets. Output goes to a temporary directory
next to ``save_dir``, renamed at the end; a failure leaves nothing behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mindspeed.checkpointing.atomic import atomic_directory, copy_assets, parse_size
from mindspeed.checkpointing.safetensors_io import HFCheckpoint, SafetensorsShardWriter
from mindspeed.log import get_logger
from mindspeed.progress import StatusProgress
from mindspeed_mm.convert.config import CONVERSIONS, DTYPES, FORMATS, NEEDS_BASE, ConvertConfig
from mindspeed_mm.convert.dcp_io import DCPModel, write_dcp
from mindspeed_mm.convert.experts import ExpertView, dcp_pair_to_hf, is_expert_pair
from mindspeed_mm.convert.names import ModelNames, model_names
from mindspeed_mm.models.diffusers_lora import read_diffusers_lora, write_diffusers_lora
from mindspeed_mm.models.lora import (
    AdapterSettings,
    adapted_modules,
    factor_names,
    is_factor,
    merge_weight,
    recorded_lora_alpha,
)
from mindspeed_mm.models.peft_io import Adapter, read_peft_adapter, write_peft_adapter_dir

logger = get_logger(__name__)


@dataclass
class ConvertReport:
    """What a conversion wrote.

    Attributes:
        source: the source, in words. target: the output directory. tensors: tensors written. nbytes: their bytes.
    """

    source: str
    target: str
    tensors: int = 0
    nbytes: int = 0

    def describe(self) -> str:
        """One line."""
        return f"converted {self.source} -> {self.target}: {self.tensors} tensors, {self.nbytes / 1e6:.3f} MB"


def check_config(config: ConvertConfig) -> None:
    """Fail early on options that cannot work (before anything is read).

    Raises:
        ValueError: an unknown format or pair, a missing directory, a target inside the source,
            a non-empty target without ``overwrite``, or a missing ``base_dir``.
    """
    for flag, value in (("--load-format", config.load_format), ("--save-format", config.save_format)):
        if value not in FORMATS:
            raise ValueError(f"{flag} must be one of {', '.join(FORMATS)}, got {value!r}")
    if config.dtype is not None and config.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    pair = (config.load_format, config.save_format)
    if pair not in CONVERSIONS:
        known = ", ".join(f"{a} -> {b}" for a, b in CONVERSIONS)
        raise ValueError(f"--load-format {pair[0]} --save-format {pair[1]} is not a conversion; use one of {known}")
    load, save = Path(config.load_dir).resolve(), Path(config.save_dir).resolve()
    if not load.is_dir():
        raise ValueError(f"--load-dir {config.load_dir} is not a directory")
    if save == load or load in save.parents:
        raise ValueError(f"--save-dir {config.save_dir} must not be --load-dir or inside it")
    if save.exists() and not save.is_dir():
        raise ValueError(f"--save-dir {config.save_dir} is a file")
    if save.is_dir() and any(save.iterdir()) and not config.overwrite:
        raise ValueError(f"--save-dir {config.save_dir} is not empty; pass --overwrite to replace it")
    if pair in NEEDS_BASE and config.base_dir is None:
        raise ValueError(f"{pair[0]} -> {pair[1]} needs --base-dir: the base Hugging Face model directory")
    if config.base_dir is not None and not (Path(config.base_dir) / "config.json").is_file():
        raise ValueError(f"--base-dir {config.base_dir} has no config.json; give the base Hugging Face model directory")
    if config.lora_alpha is not None and config.lora_alpha <= 0:
        raise ValueError(f"--lora-alpha {config.lora_alpha} must be positive")


def convert(config: ConvertConfig) -> ConvertReport:
    """Run one conversion.

    Raises:
        ValueError: bad input of any kind, with a message naming it; nothing is written then.
    """
    check_config(config)
    run = {
        ("dcp", "hf"): _dcp_to_hf,
        ("hf", "dcp"): _hf_to_dcp,
        ("dcp", "peft"): _dcp_to_adapter,
        ("peft", "dcp"): _adapter_to_dcp,
        ("peft", "hf"): _adapter_to_hf,
        ("dcp", "lora"): _dcp_to_adapter,
        ("lora", "dcp"): _adapter_to_dcp,
        ("lora", "hf"): _adapter_to_hf,
    }[(config.load_format, config.save_format)]
    report = run(config)
    logger.debug(report.describe())
    return report


def trained_name(name: str, adapted: set[str] | dict) -> str:
    """The name of a model tensor once its module holds a LoRA layer (``P.weight`` -> ``P.base_layer.weight``)."""
    prefix, _, leaf = name.rpartition(".")
    return f"{prefix}.base_layer.{leaf}" if prefix in adapted else name


def _match(have: set[str], want: set[str], where: str, what: str, optional: set[str] = frozenset()) -> None:
    extra, missing = sorted(have - want), sorted(want - have - optional)
    problems = []
    if extra:
        problems.append(f"{where} has {_tensors(len(extra))} matching no tensor of {what}: {_some(extra)}")
    if missing:
        problems.append(f"{where} lacks {_tensors(len(missing))} of {what}: {_some(missing)}")
    if problems:
        raise ValueError("; ".join(problems) + "; is --base-dir the model it belongs to?")


def _tensors(count: int) -> str:
    return f"{count} tensor" + ("s" if count != 1 else "")


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def _check_shapes(names: ModelNames, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    for name, shape in shapes.items():
        if tuple(shape) != names.shapes[name]:
            raise ValueError(
                f"{where}: {name} has shape {tuple(shape)}, {names.architecture} of --base-dir expects "
                f"{names.shapes[name]}"
            )


def _hub_keys(checkpoint: HFCheckpoint, names: ModelNames, where: str) -> dict[str, str]:
    """Module name -> the key holding it in ``checkpoint`` (strict: every tensor matched once)."""
    module_of = names.module_of()
    keys: dict[str, str] = {}
    for key in checkpoint.tensors:
        module = module_of.get(key)
        if module is not None and module in keys:
            raise ValueError(f"{where} holds {module} twice ({keys[module]} and {key})")
        if module is not None:
            keys[module] = key
    unknown = {key for key in checkpoint.tensors if key not in module_of}
    _match(set(keys) | unknown, set(names.hub), where, names.architecture)
    _check_shapes(names, {module: checkpoint.tensors[key].shape for module, key in keys.items()}, where)
    return keys


def _check_adapter(adapter: Adapter, names: ModelNames, where: str) -> None:
    for module, (a, b) in adapter.factors.items():
        shape = names.shapes.get(f"{module}.weight")
        if shape is None or len(shape) != 2:
            raise ValueError(f"{where}: {module} is not a linear of {names.architecture} of --base-dir")
        if a.shape[1] != shape[1] or b.shape[0] != shape[0]:
            raise ValueError(f"{where}: {module} has factors {tuple(a.shape)}, {tuple(b.shape)}; its weight is {shape}")


def _write_hf(
    config: ConvertConfig,
    names: ModelNames,
    plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors,
    report: ConvertReport,
) -> ConvertReport:
    """Stream ``tensors`` (an iterator of ``(hub name, tensor)``) into a Hugging Face (or diffusers) directory."""
    plan = [(name, _cast_to(config, dtype), shape) for name, dtype, shape in plan]
    with atomic_directory(Path(config.save_dir)) as temp:
        writer = SafetensorsShardWriter(
            temp, plan, parse_size(config.max_shard_size), stem=names.stem, single=names.is_diffusers
        )
        try:
            with StatusProgress("convert", total=len(plan), disable=None if config.progress else True) as bar:
                for hub, tensor in tensors:
                    tensor = tensor.to(_cast_to(config, tensor.dtype))
                    writer.write(hub, tensor.contiguous())
                    report.tensors += 1
                    report.nbytes += tensor.numel() * tensor.element_size()
                    bar.update(status=f"{report.nbytes / 1e9:.2f} GB")
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        copy_assets(Path(config.base_dir), temp)
    return report


def lora_alpha(config: ConvertConfig, checkpoint: Path) -> float | None:
    """``--lora-alpha``, else the alpha the run recorded in ``adapter_config.json`` next to its checkpoints.

    Raises:
        ValueError: both are there and differ.
    """
    return recorded_lora_alpha(checkpoint, config.lora_alpha)


def _averages(source: DCPModel) -> str:
    """How the report names the weights read from a checkpoint."""
    if source.ema_names:
        return f", moving averages of {len(source.ema_names)} trained tensors"
    return ", raw weights (--no-ema)" if source.has_ema else ""


def _dcp_to_hf(config: ConvertConfig, source: DCPModel | ExpertView | None = None) -> ConvertReport:
    source = source if source is not None else DCPModel(config.load_dir, ema=config.ema)
    if is_expert_pair(source):  # a Wan2.2 `diffusion.expert=both` run: both experts' folders
        return dcp_pair_to_hf(config, source, _dcp_to_hf)
    names = model_names(config.base_dir)
    adapted = set(adapted_modules(source.tensors))
    alpha = lora_alpha(config, source.path) if adapted else None
    if adapted and alpha is None:
        raise ValueError(
            f"{source.path} holds LoRA factors on {len(adapted)} linears and no adapter_config.json "
            "records alpha: pass --lora-alpha (the recipe's lora.alpha) to merge them, or "
            "--save-format peft for the adapter alone"
        )
    if adapted and all(is_factor(name) for name in source.tensors):  # a LoRA run's: the factors over --base-dir
        adapter = _dcp_adapter(config, source, sorted(adapted), alpha, cast=False)  # merged in fp32, then cast
        what = f"DCP {source.path} (LoRA on {len(adapted)} linears{_averages(source)}) merged into"
        return _merge_to_hf(config, adapter, what)
    want = {trained_name(name, adapted) for name in names.shapes} | {f for m in adapted for f in factor_names(m)}
    _match(
        set(source.tensors),
        want,
        str(source.path),
        names.architecture,
        optional={trained_name(name, adapted) for name in names.tied},
    )
    _check_shapes(names, {name: source.tensors[trained_name(name, adapted)][1] for name in names.hub}, str(source.path))
    factors = source.read(sorted(f for m in adapted for f in factor_names(m))) if adapted else {}
    order = list(names.hub)
    plan = [(names.hub[name], source.tensors[trained_name(name, adapted)][0], names.shapes[name]) for name in order]
    module_of = {trained_name(name, adapted): name for name in order}

    def tensors():
        for batch in source.batches([trained_name(name, adapted) for name in order]):
            for stored, tensor in batch.items():
                name = module_of[stored]
                prefix, _, leaf = name.rpartition(".")
                if prefix in adapted and leaf == "weight":
                    r = factors[factor_names(prefix)[0]].shape[0]
                    tensor = merge_weight(tensor, *(factors[f] for f in factor_names(prefix)), alpha / r)
                yield names.hub[name], tensor

    what = f"DCP {source.path}" + (f" (LoRA on {len(adapted)} linears merged)" if adapted else "") + _averages(source)
    return _write_hf(config, names, plan, tensors(), ConvertReport(what, f"hf {config.save_dir}"))


def _hf_to_dcp(config: ConvertConfig) -> ConvertReport:
    names = model_names(config.load_dir)
    checkpoint = HFCheckpoint(config.load_dir, stem=names.stem)
    keys = _hub_keys(checkpoint, names, str(config.load_dir))
    keys.update({name: keys[source] for name, source in names.tied.items()})
    specs = {name: (checkpoint.tensors[keys[name]].dtype, names.shapes[name]) for name in names.shapes}
    return _save_dcp(config, specs, lambda name: checkpoint.read(keys[name]), f"hf {config.load_dir}")


def _cast_to(config: ConvertConfig, dtype: torch.dtype) -> torch.dtype:
    """``--dtype`` for floating-point tensors (others keep theirs)."""
    return getattr(torch, config.dtype) if config.dtype and dtype.is_floating_point else dtype


def _save_dcp(
    config: ConvertConfig, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], read, source: str
) -> ConvertReport:
    specs = {name: (_cast_to(config, dtype), shape) for name, (dtype, shape) in specs.items()}
    with atomic_directory(Path(config.save_dir)) as temp:
        write_dcp(specs, lambda name: read(name).to(specs[name][0]), temp)
    return ConvertReport(
        source,
        f"dcp {config.save_dir}",
        len(specs),
        sum(dtype.itemsize * int(torch.Size(shape).numel()) for dtype, shape in specs.values()),
    )


def _dcp_adapter(
    config: ConvertConfig, source: DCPModel, adapted: list[str], alpha: float, cast: bool = True
) -> Adapter:
    """The LoRA factors of a DCP checkpoint as an adapter (cast as ``--dtype`` says, unless not ``cast``)."""
    factors = {
        name: t.to(_cast_to(config, t.dtype) if cast else t.dtype)
        for name, t in source.read(sorted(f for m in adapted for f in factor_names(m))).items()
    }
    pairs = {m: (factors[factor_names(m)[0]], factors[factor_names(m)[1]]) for m in adapted}
    ranks = sorted({a.shape[0] for a, _ in pairs.values()})
    if len(ranks) != 1:
        raise ValueError(f"{source.path}: the LoRA factors have ranks {ranks}; a PEFT adapter here has one rank")
    return Adapter(AdapterSettings(ranks[0], alpha, list(adapted)), pairs)


def _read_adapter(config: ConvertConfig) -> Adapter:
    """The adapter of ``--load-dir``: a PEFT directory, or a diffusers LoRA (``--load-format lora``)."""
    return read_diffusers_lora(config.load_dir) if config.load_format == "lora" else read_peft_adapter(config.load_dir)


def _dcp_to_adapter(config: ConvertConfig) -> ConvertReport:
    source = DCPModel(config.load_dir, ema=config.ema)
    adapted = adapted_modules(source.tensors)
    if not adapted:
        raise ValueError(
            f"{source.path} holds no LoRA factors (lora_A / lora_B); it is a full fine-tuning "
            "checkpoint: convert it with --save-format hf"
        )
    alpha = lora_alpha(config, source.path)
    if alpha is None:
        raise ValueError(
            f"{source.path}: no adapter_config.json records alpha; pass --lora-alpha (the recipe's lora.alpha)"
        )
    adapter = _dcp_adapter(config, source, adapted, alpha)
    if config.base_dir is not None:
        _check_adapter(adapter, model_names(config.base_dir), str(source.path))
    with atomic_directory(Path(config.save_dir)) as temp:
        if config.save_format == "lora":
            write_diffusers_lora(adapter, temp)
        else:
            write_peft_adapter_dir(adapter, temp, config.base_dir)
    factors = [t for pair in adapter.factors.values() for t in pair]
    return ConvertReport(
        f"DCP {source.path} (LoRA r={adapter.settings.r}{_averages(source)})",
        f"{config.save_format} {config.save_dir}",
        len(factors),
        sum(t.numel() * t.element_size() for t in factors),
    )


def _adapter_to_dcp(config: ConvertConfig) -> ConvertReport:
    adapter = _read_adapter(config)
    names = model_names(config.base_dir)
    _check_adapter(adapter, names, str(config.load_dir))
    base = HFCheckpoint(config.base_dir, stem=names.stem)
    keys = _hub_keys(base, names, str(config.base_dir))
    keys.update({name: keys[source] for name, source in names.tied.items()})
    stored = {trained_name(name, adapter.factors): name for name in names.shapes}
    factors = {
        f: t for module, pair in adapter.factors.items() for f, t in zip(factor_names(module), pair, strict=True)
    }
    specs = {trained: (base.tensors[keys[name]].dtype, names.shapes[name]) for trained, name in stored.items()}
    specs.update({name: (t.dtype, tuple(t.shape)) for name, t in factors.items()})

    def read(name: str) -> torch.Tensor:
        return factors[name] if name in factors else base.read(keys[stored[name]])

    return _save_dcp(config, specs, read, f"{config.load_format} {config.load_dir} over {config.base_dir}")


def _adapter_to_hf(config: ConvertConfig) -> ConvertReport:
    return _merge_to_hf(config, _read_adapter(config), f"{config.load_format} {config.load_dir} merged into")


def _merge_to_hf(config: ConvertConfig, adapter: Adapter, what: str) -> ConvertReport:
    """``--base-dir`` with ``adapter`` merged in, as a Hugging Face directory."""
    names = model_names(config.base_dir)
    _check_adapter(adapter, names, str(config.load_dir))
    base = HFCheckpoint(config.base_dir, stem=names.stem)
    keys = _hub_keys(base, names, str(config.base_dir))
    plan = [(names.hub[name], base.tensors[keys[name]].dtype, names.shapes[name]) for name in names.hub]

    def tensors():
        for name in names.hub:
            tensor = base.read(keys[name])
            prefix, _, leaf = name.rpartition(".")
            if prefix in adapter.factors and leaf == "weight":
                tensor = merge_weight(tensor, *adapter.factors[prefix], adapter.settings.scale)
            yield names.hub[name], tensor

    return _write_hf(
        config, names, plan, tensors(), ConvertReport(f"{what} {config.base_dir}", f"hf {config.save_dir}")
    )
