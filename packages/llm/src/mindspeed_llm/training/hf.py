"""Training straight from a Hugging Face directory, and exporting the trained model back to one.

``checkpoint.load_hf`` fills the recipe's ``model`` section from the directory's ``config.json``
(through the family's bridge), takes its tokenizer, and loads its weights on every rank: each
rank reads only the tensors whose pieces it holds, converts them with the bridge's rules and
cuts them for the run's TP/PP/VPP/EP layout, one tensor at a time. ``checkpoint.save_hf``
writes the final weights of every rank as a per-rank Megatron checkpoint (megatron's legacy
layout, with the model recorded in its args) into a temporary directory, then rank 0 runs
``convert-ckpt`` on it: sharded safetensors, ``config.json``, ``generation_config.json`` and the
tokenizer, which transformers, vLLM and PEFT load.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.config import ConfigError
from mindspeed.features.pipeline import noop_layer_layout
from mindspeed.log import get_logger, logged_as_detail
from mindspeed_llm.bridges import (
    ParallelLayout,
    RankKey,
    Split,
    bridge_for_shape,
    plan_conversion,
    require_capability,
    split_tensor,
)
from mindspeed_llm.bridges.base import causal_architecture, score_architecture
from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.checkpoint.endpoints import HFSource, pick_bridge, read_hf_config
from mindspeed_llm.checkpoint.megatron_legacy import TRACKER, checkpoint_args, iteration_dir, model_keys, rank_dir
from mindspeed_llm.tokenizer import load_tokenizer
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.lora_io import save_lora_adapter
from mindspeed_llm.training.model import default_groups, unwrap
from mindspeed_llm.training.sections import ModelConfig, ParallelConfig

logger = get_logger(__name__)


def read_hf_shape(path: str | Path) -> tuple[Any, Any, str]:
    """``(bridge, ModelShape, architecture)`` of a Hugging Face directory.

    Raises:
        ConfigError: no ``config.json``, or an architecture no bridge knows.
    """
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"checkpoint.load_hf={path!r} has no config.json; give a Hugging Face model directory")
    try:
        raw, config = read_hf_config(directory)
        bridge = pick_bridge(None, raw.get("architectures"))
    except ValueError as err:
        raise ConfigError(f"checkpoint.load_hf: {err}") from err
    known = [a for a in raw.get("architectures") or [] if causal_architecture(a) in bridge.hf_architectures]
    return bridge, bridge.shape_from_hf(config), (known[0] if known else bridge.hf_architectures[0])


def hf_model_shape(path: str | Path, precision: str = "fp32") -> Any:
    """The :class:`~mindspeed.model.ModelShape` of a Hugging Face directory, for training in ``precision``.

    Raises:
        ConfigError: an unreadable directory, or a family whose bridge does not declare ``trains``.
    """
    bridge, shape, _ = read_hf_shape(path)
    try:
        require_capability(bridge, "trains")
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from err
    return dataclasses.replace(shape, params_dtype="bfloat16" if precision == "bf16" else "float32")


def apply_load_hf(config: PretrainConfig) -> PretrainConfig:
    """The recipe with its ``model`` section read from ``checkpoint.load_hf`` (unchanged without it).

    Model fields the recipe sets must agree with the directory's config; the tokenizer defaults
    to the directory's, and the vocabulary is padded only as tensor parallelism needs
    (``make_vocab_size_divisible_by=1``) so the logits are those of the Hugging Face model.

    Raises:
        ConfigError: an unreadable directory, a model the trainer cannot build, or a recipe value
            that contradicts the directory's config.
    """
    path = config.checkpoint.load_hf
    if not path:
        return config
    bridge, shape, _ = read_hf_shape(path)
    try:
        require_capability(bridge, "trains")
    except ValueError as err:
        raise ConfigError(f"checkpoint.load_hf: {err}; convert it with convert-ckpt for inspection") from err
    default, model = ModelConfig(), config.model
    values = ModelConfig.shape_values(shape)
    values["num_layers"] += len(model.noop_indices())  # a recipe counts its noop layers among the layers
    for key, value in values.items():
        mine = getattr(model, key)
        if mine != getattr(default, key) and mine != value:
            raise ConfigError(
                f"model.{key}={mine!r} contradicts checkpoint.load_hf's config ({value!r}); remove it from the recipe"
            )
    divisible = (
        1
        if model.make_vocab_size_divisible_by == default.make_vocab_size_divisible_by
        else model.make_vocab_size_divisible_by
    )
    new_model = dataclasses.replace(model, **values, make_vocab_size_divisible_by=divisible)
    data = config.data
    if not data.tokenizer and any(
        (Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        data = dataclasses.replace(data, tokenizer=str(path))
    if data.eod_token_id is None and not data.tokenizer:
        eos = _eos_token_id(Path(path))
        if eos is not None:
            data = dataclasses.replace(data, eod_token_id=eos)
    return dataclasses.replace(config, model=new_model, data=data)


def _eos_token_id(directory: Path) -> int | None:
    import json

    eos = json.loads((directory / "config.json").read_text()).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def _layout(config: PretrainConfig) -> Any:
    noop = config.model.noop_indices()
    return _parallel_layout(config.parallel, config.model.num_layers - len(noop), noop)


def _parallel_layout(p: ParallelConfig, num_layers: int, noop: tuple[int, ...] = (), dualpipev: bool = False) -> Any:
    """The bridges' layout of ``num_layers`` real layers on ``p`` (with ``noop`` layers among them)."""
    if dualpipev:  # the feature refuses noop layers and parallel.vpp alongside the V
        return ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, dualpipev=True)
    if not noop or p.pp == 1:
        return ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, vpp_layers=num_layers // (p.pp * p.vpp) if p.vpp else None)
    # Noop layers: each stage holds its real layers (megatron's layout), an uneven split.
    counts = [stage.count("decoder") for stage in noop_layer_layout(noop, num_layers + len(noop), p.pp, p.vpp or 1)]
    if p.vpp or 0 in counts:
        raise ConfigError(
            f"model.noop_layers {list(noop)} leave pipeline stages with {counts} real layers: Hugging Face import "
            "and export need every stage to hold a real layer and no parallel.vpp; move the noop layers"
        )
    return ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, num_layer_list=tuple(counts))


def _my_rank(groups: Any) -> Any:
    return RankKey(groups.tp.rank(), groups.pp.rank(), groups.ep.rank())


def _vocab_pieces(full: torch.Tensor, rows: int, tp: int) -> list[torch.Tensor]:
    if full.shape[0] < rows:
        full = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))])
    return list(full.chunk(tp, dim=0))


def load_hf_weights(
    chunks: list[Any],
    path: str | Path,
    parallel: ParallelConfig,
    vocab_rows: int,
    groups: Any = None,
    noop_layers: tuple[int, ...] = (),
    keep: tuple[str, ...] = (),
    dualpipev: bool = False,
) -> None:
    """Load this rank's pieces of the Hugging Face weights in ``path`` into ``chunks`` (collective).

    Args:
        chunks: this rank's model chunks (bare or wrapped) of the directory's model.
        path: the Hugging Face directory.
        parallel: the layout the chunks were built for.
        vocab_rows: the padded rows of the embedding.
        groups: the process groups (``training.model.default_groups()``; ``None``: read them
            here): which pieces are this rank's.
        noop_layers: the recipe's noop layer indices (``model.noop_indices()``): the stages hold
            the real layers between them.
        keep: megatron names left as initialised unless the directory has a tensor of their
            shape (a reward model's score head started from a language model, whose
            ``lm_head`` it does not take).
        dualpipev: the chunks are DualPipeV's V (``build_gpt_chunks(dualpipev=True)``).

    Raises:
        ConfigError: the directory's tensors do not match its config, or leave a parameter of
            this rank's model unset.
    """
    try:
        source = HFSource(Path(path))
        plan = plan_conversion(source.bridge, source.shape, source.hf_shapes())
    except ValueError as err:
        raise ConfigError(f"checkpoint.load_hf: {err}") from err
    groups = groups if groups is not None else default_groups()
    layout = _parallel_layout(parallel, source.shape.num_layers, noop_layers, dualpipev)
    me = _my_rank(groups)
    states = [unwrap(chunk).state_dict(keep_vars=True) for chunk in chunks]
    expected = {(i, name) for i, state in enumerate(states) for name in state if not name.endswith("_extra_state")}
    loaded = set()
    with torch.no_grad():
        for task in plan.tasks:
            param = plan.params[task.mg_name]
            mine = [piece for piece in layout.place(param, source.shape) if piece.rank == me]
            if not mine:
                continue
            full = source.read(task, plan)
            parts = (
                _vocab_pieces(full, vocab_rows, layout.tp)
                if param.split is Split.VOCAB
                else split_tensor(param, full, layout.tp)
            )
            for piece in mine:
                target = states[piece.chunk].get(piece.name)
                if task.mg_name in keep and (target is None or target.shape != parts[piece.tp_index].shape):
                    continue  # another kind of head: this one keeps its initialisation
                if target is None or tuple(target.shape) != tuple(parts[piece.tp_index].shape):
                    got = None if target is None else tuple(target.shape)
                    raise ConfigError(
                        f"checkpoint.load_hf: {task.mg_name} does not fit this rank's model "
                        f"({piece.name}: model {got}, checkpoint {tuple(parts[piece.tp_index].shape)})"
                    )
                target.copy_(parts[piece.tp_index])
                loaded.add((piece.chunk, piece.name))
    missing = sorted(name for _, name in expected - loaded if name not in keep)
    if missing:
        raise ConfigError(f"checkpoint.load_hf: {path} leaves these parameters of the model unset: {missing[:6]}")
    logger.info("loaded %d tensors of %s (%s) into this rank's model", len(loaded), path, source.bridge.family)


def model_shape(config: PretrainConfig, vocab_size: int) -> Any:
    """The :class:`~mindspeed.model.ModelShape` the recipe trains (the one description every view derives from).

    ``checkpoint.load_hf``'s model as its family's bridge reads it (every feature the bridge
    knows: MLA, shared experts, dense layers between MoE layers ...) in the run's precision, else
    the recipe's ``model`` section.

    Args:
        config: the recipe (after :func:`apply_load_hf`).
        vocab_size: the tokenizer's vocabulary.
    """
    if config.checkpoint.load_hf:
        shape = hf_model_shape(config.checkpoint.load_hf, config.train.precision)
    else:
        shape = config.model.to_shape(vocab_size, config.data.seq_length, config.train.precision)
    # A reward model's output layer is a score head of one row, whatever the model started as.
    return dataclasses.replace(shape, num_labels=1) if config.stage == "rm" else shape


def export_shape(config: PretrainConfig, vocab_size: int) -> tuple[Any, Any, str, Path | None]:
    """``(bridge, shape, architecture, assets)`` of the trained model for export.

    From ``checkpoint.load_hf`` when the run started there (its config and tokenizer files are
    the assets), else from the recipe's model (the first family whose bridge writes its shape).
    """
    shape = model_shape(config, vocab_size)
    if config.checkpoint.load_hf:
        bridge, _, architecture = read_hf_shape(config.checkpoint.load_hf)
        assets: Path | None = Path(config.checkpoint.load_hf)
    else:
        try:
            bridge = bridge_for_shape(shape)
        except ValueError as err:
            raise ConfigError(f"checkpoint.save_hf: {err}") from err
        architecture, assets = bridge.hf_architectures[0], None
    if shape.num_labels:  # a reward model: transformers' sequence classification of the family
        architecture = score_architecture(causal_architecture(architecture))
    return bridge, shape, architecture, assets


def checkpoint_args_of(config: PretrainConfig, vocab_size: int, vocab_rows: int) -> Any:
    """The megatron ``args`` the trainer's checkpoints record (``None`` for a model no bridge exports).

    With them ``convert-ckpt --load-model-type mg`` and the inference engine read a training
    checkpoint as they read a converted one (dense models; LoRA factors and grouped experts are
    not in the bridges' names).
    """
    try:
        bridge, shape, architecture, _ = export_shape(config, vocab_size)
    except (ConfigError, ValueError):
        return None
    args = checkpoint_args(shape, _layout(config), bridge.family, architecture, vocab_rows)
    args.ckpt_format = "torch_dist"
    return args


def _export_state(chunk: Any, vocab_size: int, tp: int) -> dict[str, torch.Tensor]:
    # The base weights as megatron names them: QLoRA's NF4 weights dequantised (they have no
    # state-dict entry), LoRA factors left out (they are merged by the converter).
    from mindspeed_llm.training.lora import is_lora_key

    model = unwrap(chunk)
    state = {
        name: tensor.detach().cpu()
        for name, tensor in model.state_dict().items()
        if not name.endswith("_extra_state") and not is_lora_key(name)
    }
    dtype = next(p for p in model.parameters()).dtype
    for name, module in model.named_modules():
        if hasattr(module, "dequantized_weight"):
            state[f"{name}.weight"] = module.dequantized_weight(dtype).detach().cpu()
    if tp == 1:  # one piece: drop the padding rows here (several pieces are glued, then cut)
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in state:
                state[name] = state[name][:vocab_size].clone()
    return state


#: Where :func:`save_hf` stages the megatron checkpoint (and a LoRA adapter) next to its target.
STAGING_SUFFIXES = (".megatron-tmp", ".megatron-tmp-lora")


def save_hf(
    chunks: list[Any],
    config: PretrainConfig,
    step: int,
    vocab_size: int,
    vocab_rows: int,
    lora: Any = None,
    groups: Any = None,
) -> Path:
    """Write the model as a Hugging Face directory at ``checkpoint.save_hf`` (collective).

    Args:
        chunks: this rank's model chunks.
        config: the recipe.
        step: recorded as the iteration.
        vocab_size: the tokenizer's vocabulary (the Hugging Face embedding rows).
        vocab_rows: the padded rows of the megatron embedding.
        lora: the run's ``LoraSettings``: the adapter is merged into the exported weights (in
            float32 math, stored in the weights' dtype).
        groups: the process groups (``training.model.default_groups()``; ``None``: read them here).
    """
    groups = groups if groups is not None else default_groups()
    target = Path(config.checkpoint.save_hf)
    bridge, shape, architecture, assets = export_shape(config, vocab_size)
    layout = _layout(config)
    staging = target.with_name(target.name + STAGING_SUFFIXES[0])
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    # One writer per (tp, pp, ep) piece: with expert parallelism the expert ranks > 0 sit at
    # data-parallel ranks > 0 (their dense weights are the data-parallel replicas' own).
    writer = (groups.expt_dp if layout.ep > 1 else groups.dp).rank() == 0
    if writer:
        args = checkpoint_args(shape, layout, bridge.family, architecture, vocab_rows, iteration=step)
        keys = model_keys(len(chunks))
        state = {"args": args, "checkpoint_version": 3.0, "iteration": step}
        for key, chunk in zip(keys, chunks):
            state[key] = _export_state(chunk, vocab_size, layout.tp)
        folder = staging / iteration_dir(step) / rank_dir(_my_rank(groups), layout)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "model_optim_rng.pt")
    dist.barrier()
    adapter = None
    if lora is not None:
        adapter = target.with_name(target.name + STAGING_SUFFIXES[1])
        save_lora_adapter(chunks, adapter, shape, None, lora, groups)
    if rank0:
        try:
            (staging / TRACKER).write_text(f"{step}\n")
            with logged_as_detail("mindspeed_llm.checkpoint.convert"):  # its report is the run log's
                convert_checkpoint(
                    ConvertConfig(
                        load_model_type="mg",
                        save_model_type="hf",
                        load_dir=staging,
                        save_dir=target,
                        hf_cfg_dir=assets,
                        overwrite=True,
                        progress=False,
                        lora_load=adapter,
                        save_hf_dtype=config.checkpoint.save_hf_dtype,
                    )
                )
            if assets is None and config.data.tokenizer:
                load_tokenizer(config.data.tokenizer).save_pretrained(str(target))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if adapter is not None:
                shutil.rmtree(adapter, ignore_errors=True)
        logger.info("saved the model as a Hugging Face directory: %s", target)
    dist.barrier()
    return target
