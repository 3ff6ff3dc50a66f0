"""``convert-ckpt``: Hugging Face <-> Megatron conversion, planned, streamed, written atomically.

:func:`convert_checkpoint` opens the source (:class:`HFSource` or :class:`MegatronSource`),
plans the whole conversion with the family's bridge (every tensor matched on both sides, shapes
checked), checks the target layout, and only then writes: into a temporary directory next to
the target, one tensor in memory at a time, each output file finished as soon as its last tensor
arrives, renamed onto the target at the end. A failure at any point leaves nothing behind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mindspeed.checkpointing.atomic import atomic_directory, copy_assets, parse_size
from mindspeed.checkpointing.hf_dtype import SAVE_HF_DTYPES, target_dtype, write_config_dtype
from mindspeed.log import get_logger
from mindspeed.progress import StatusProgress
from mindspeed_llm.bridges import ParallelLayout, plan_conversion
from mindspeed_llm.bridges.base import causal_architecture, score_architecture
from mindspeed_llm.checkpoint.endpoints import HFSink, HFSource, MegatronSink, MegatronSource, OutputFile
from mindspeed_llm.checkpoint.lora import LoraCheckpoint, LoraMergedSource, export_peft_adapter
from mindspeed_llm.checkpoint.megatron_dist import DistSink, DistSource, is_dist_checkpoint

logger = get_logger(__name__)

#: Where a conversion from Hugging Face keeps the source's config and tokenizer inside a Megatron checkpoint.
HF_ASSETS = "hf_config"


@dataclass(kw_only=True)
class ConvertConfig:
    """Every ``convert-ckpt`` option (the CLI flags are these names with dashes).

    Attributes:
        load_model_type: ``hf`` or ``mg``.
        save_model_type: ``mg`` or ``hf``.
        load_dir: the source checkpoint directory.
        save_dir: the output directory (created; must be empty unless ``overwrite``).
        target_tensor_parallel_size: TP of a Megatron output.
        target_pipeline_parallel_size: PP of a Megatron output.
        target_expert_parallel_size: EP of a Megatron output.
        num_layers_per_virtual_pipeline_stage: virtual pipeline stage size of a Megatron output.
        num_layer_list: comma-separated layers per pipeline stage of a Megatron output.
        model_type_hf: family override (MindSpeed-LLM's names: llama2, mistral, qwen25, qwen3, mixtral,
            qwen3-moe, deepseek3).
        hf_cfg_dir: directory with config.json and tokenizer files for a Hugging Face output.
        lora_load: a Megatron LoRA checkpoint to merge into the base weights (or to export).
        save_lora_to_hf: write the LoRA weights as a PEFT adapter instead of merged weights.
        lora_r: LoRA rank when the LoRA checkpoint's args do not record it.
        lora_alpha: LoRA alpha when the LoRA checkpoint's args do not record it.
        mtp_num_layers: multi-token-prediction layers of a Hugging Face checkpoint to convert into
            megatron's MTP block (DeepSeek-V3's num_nextn_predict_layers; default: none, they are
            dropped); a Megatron source converts the ones its args record.
        ckpt_format: Megatron output format: ``torch`` (per-rank files) or ``torch_dist``
            (megatron-core dist checkpoint); a Megatron source's format is detected.
        max_shard_size: safetensors shard size of a Hugging Face output ("5GB", "500MB", bytes).
        save_hf_dtype: dtype of a Hugging Face output's tensors: auto (as the source holds them),
            float32, bfloat16 or float16; its config.json says the dtype written.
        dry_run: plan and report, write nothing.
        overwrite: replace a non-empty ``save_dir``.
        progress: draw a progress bar.
    """

    load_model_type: str = "hf"
    save_model_type: str = "mg"
    load_dir: Path
    save_dir: Path
    target_tensor_parallel_size: int = 1
    target_pipeline_parallel_size: int = 1
    target_expert_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_layer_list: str | None = None
    model_type_hf: str | None = None
    hf_cfg_dir: Path | None = None
    lora_load: Path | None = None
    save_lora_to_hf: bool = False
    lora_r: int | None = None
    lora_alpha: float | None = None
    mtp_num_layers: int | None = None
    ckpt_format: str = "torch"
    max_shard_size: str = "5GB"
    save_hf_dtype: str = "auto"
    dry_run: bool = False
    overwrite: bool = False
    progress: bool = True

    def target_layout(self) -> ParallelLayout:
        """The Megatron layout the ``target_*`` options describe."""
        layers = None
        if self.num_layer_list:
            try:
                layers = tuple(int(x) for x in self.num_layer_list.split(","))
            except ValueError:
                raise ValueError(
                    f"--num-layer-list {self.num_layer_list!r} is not a comma-separated list of integers"
                ) from None
        return ParallelLayout(
            tp=self.target_tensor_parallel_size,
            pp=self.target_pipeline_parallel_size,
            ep=self.target_expert_parallel_size,
            vpp_layers=self.num_layers_per_virtual_pipeline_stage,
            num_layer_list=layers,
        )


@dataclass
class ConversionReport:
    """What a conversion does (or, with ``--dry-run``, would do).

    Attributes:
        source: the source, in words.
        target: the target, in words.
        family: the bridge family.
        tensors_read: megatron tensors assembled (one per conversion task).
        dropped: source tensors deliberately not converted.
        files: every output file with its tensor count and bytes.
        written: whether anything was written.
    """

    source: str
    target: str
    family: str
    tensors_read: int
    dropped: list[str] = field(default_factory=list)
    files: list[OutputFile] = field(default_factory=list)
    written: bool = False

    @property
    def total_bytes(self) -> int:
        """Bytes of all output files' tensors."""
        return sum(f.nbytes for f in self.files)

    def describe(self) -> str:
        """The plan as text: one line per output file."""
        lines = [
            f"{'converted' if self.written else 'plan'}: {self.source} -> {self.target}",
            f"family {self.family}: {self.tensors_read} megatron tensors, {len(self.files)} output files, "
            f"{self.total_bytes / 1e6:.3f} MB",
        ]
        if self.dropped:
            lines.append(f"dropped (no weights): {', '.join(self.dropped)}")
        lines += [f"  {f.path}: {f.tensors} tensors, {f.nbytes / 1e6:.3f} MB" for f in self.files]
        return "\n".join(lines)


def check_paths(config: ConvertConfig) -> None:
    """Fail early on directories that cannot work (before any reading).

    Raises:
        ValueError: a missing source, an unknown model type, a target inside the source, or a
            non-empty target without ``overwrite``.
    """
    for flag, value, allowed in (
        ("--load-model-type", config.load_model_type, ("hf", "mg")),
        ("--save-model-type", config.save_model_type, ("mg", "hf")),
        ("--ckpt-format", config.ckpt_format, ("torch", "torch_dist")),
        ("--save-hf-dtype", config.save_hf_dtype, SAVE_HF_DTYPES),
    ):
        if value not in allowed:
            raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if config.load_model_type == "hf" and config.save_model_type == "hf":
        raise ValueError("--load-model-type hf with --save-model-type hf converts nothing; save to mg")
    load, save = Path(config.load_dir).resolve(), Path(config.save_dir).resolve()
    if not load.is_dir():
        raise ValueError(f"--load-dir {config.load_dir} is not a directory")
    if save == load or load in save.parents:
        raise ValueError(f"--save-dir {config.save_dir} must not be --load-dir or inside it")
    if save.exists() and not save.is_dir():
        raise ValueError(f"--save-dir {config.save_dir} is a file")
    if save.is_dir() and any(save.iterdir()) and not config.overwrite:
        raise ValueError(f"--save-dir {config.save_dir} is not empty; pass --overwrite to replace it")
    if config.hf_cfg_dir is not None and not (Path(config.hf_cfg_dir) / "config.json").is_file():
        raise ValueError(f"--hf-cfg-dir {config.hf_cfg_dir} has no config.json")


def score_model_config(config: dict, num_labels: int) -> dict:
    """``config.json`` of a language model rewritten for its ``*ForSequenceClassification`` model.

    ``num_labels`` rows of ``score``; ``pad_token_id`` is set, as transformers scores a sequence
    at its last token that is not padding (and refuses batches without a pad id): the config's
    own unless it is the end-of-sequence token (answers end with it), else 0 (1 if that is it).
    """
    out = dict(config)
    out["architectures"] = [score_architecture(causal_architecture(a)) for a in config.get("architectures") or []]
    out["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    out["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    eos = config.get("eos_token_id")
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    pad = config.get("pad_token_id")
    if pad is None or pad in eos_ids:
        pad = 0 if 0 not in eos_ids else 1
    out["pad_token_id"] = pad
    return out


def _write_score_config(directory: Path, num_labels: int) -> None:
    path = directory / "config.json"
    config = score_model_config(json.loads(path.read_text()), num_labels)
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    temp.replace(path)


def _write_hf_assets(source, directory: Path, hf_cfg_dir: Path | None, dtype: torch.dtype | None) -> None:
    # config.json says the dtype of the tensors written: transformers loads in that dtype by default.
    copied = copy_assets(hf_cfg_dir or source.assets, directory)
    if "config.json" in copied:
        write_config_dtype(directory / "config.json", dtype)
        if source.shape.num_labels:
            _write_score_config(directory, source.shape.num_labels)
        return
    # No config.json anywhere: rebuild one from the checkpoint's recorded model.
    config = source.bridge.hf_config_from_shape(source.shape)
    config.save_pretrained(str(directory))
    write_config_dtype(directory / "config.json", dtype)
    if source.shape.num_labels:
        _write_score_config(directory, source.shape.num_labels)
    if "generation_config.json" not in copied:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(str(directory))
    logger.warning(
        "no config.json for the Hugging Face output: wrote one derived from the checkpoint's args; "
        "pass --hf-cfg-dir to copy the original config and tokenizer files"
    )


def _export_lora(config: ConvertConfig, source, plan, lora) -> ConversionReport:
    if lora is None:
        raise ValueError("--save-lora-to-hf exports the weights of --lora-load; pass --lora-load")
    if config.save_model_type != "hf":
        raise ValueError("--save-lora-to-hf writes a PEFT adapter; pass --save-model-type hf")
    count = sum(len(task.hf_names) for task in plan.tasks if task.mg_name.rsplit(".", 1)[0] in lora.targets)
    report = ConversionReport(
        f"{source.describe()} + LoRA {config.lora_load}",
        "hf (PEFT adapter)",
        plan.bridge.family,
        2 * len(lora.targets),
        files=[OutputFile("adapter_model.safetensors", 2 * count)],
    )
    if config.dry_run:
        return report
    with atomic_directory(Path(config.save_dir)) as temp:
        export_peft_adapter(plan, lora, temp, str(config.load_dir))
        report.files[0].nbytes = (temp / "adapter_model.safetensors").stat().st_size
    report.written = True
    logger.info(report.describe())
    return report


def convert_checkpoint(config: ConvertConfig) -> ConversionReport:
    """Run (or with ``dry_run`` only plan) one conversion.

    Args:
        config: the options.

    Returns:
        The report (files, tensor counts, bytes).

    Raises:
        ValueError: bad input of any kind, with a message naming it; nothing is written then.
    """
    check_paths(config)
    load = Path(config.load_dir)
    hf_cfg_dir = Path(config.hf_cfg_dir) if config.hf_cfg_dir else None
    if config.load_model_type == "hf":
        source = HFSource(load, config.model_type_hf, config.mtp_num_layers)
    elif is_dist_checkpoint(load):
        source = DistSource(load, config.model_type_hf, hf_cfg_dir)
    else:
        source = MegatronSource(load, config.model_type_hf, hf_cfg_dir)
    if (
        config.load_model_type == "mg"
        and config.mtp_num_layers is not None
        and config.mtp_num_layers != (source.shape.mtp_num_layers or 0)
    ):
        raise ValueError(
            f"--mtp-num-layers {config.mtp_num_layers}: {load} holds {source.shape.mtp_num_layers or 0} "
            "multi-token-prediction layers (a Megatron source converts those; leave the flag out)"
        )
    plan = plan_conversion(source.bridge, source.shape, source.hf_shapes())
    if hasattr(source, "check_copies"):
        source.check_copies(plan)
    lora = (
        LoraCheckpoint(Path(config.lora_load), source.shape, config.lora_r, config.lora_alpha)
        if config.lora_load
        else None
    )
    if config.save_lora_to_hf:
        return _export_lora(config, source, plan, lora)
    if lora is not None:
        source = LoraMergedSource(source, lora)
    if config.save_model_type == "mg":
        layout = config.target_layout()
        layout.check(plan.shape)
        sink = (DistSink if config.ckpt_format == "torch_dist" else MegatronSink)(plan, layout, source)
    else:
        sink = HFSink(plan, source, parse_size(config.max_shard_size), target_dtype(config.save_hf_dtype))
    report = ConversionReport(
        source.describe(), sink.describe(), plan.bridge.family, len(plan.tasks), plan.dropped_hf, sink.files
    )
    if config.dry_run:
        return report
    # Sources that can hand out views do (see mindspeed.checkpointing.blocks): the sinks then
    # write every byte straight from the source files' mappings into the output files.
    read = getattr(source, "read_blocks", source.read)
    with atomic_directory(Path(config.save_dir)) as temp:
        sink.open(temp)
        try:
            written = 0
            with StatusProgress(
                "convert-ckpt", total=len(plan.tasks), disable=None if config.progress else True
            ) as bar:
                for task in plan.tasks:
                    full = read(task, plan)
                    sink.put(task, full)
                    written += full.nbytes
                    bar.update(status=f"{written / 1e9:.2f} GB")
            sink.finish()
        except BaseException:
            sink.abort()
            raise
        if config.save_model_type == "hf":
            _write_hf_assets(source, temp, hf_cfg_dir, sink.dtype)
        else:
            copy_assets(hf_cfg_dir or source.assets, temp / HF_ASSETS)
    report.written = True
    logger.info(report.describe())
    return report
