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
from mindspeed.log import get_logger, logged_as_detail
from mindspeed_llm.bridges import (
    ModelShape,
    ParallelLayout,
    RankKey,
    Split,
    bridge_for_family,
    plan_conversion,
    split_tensor,
)
from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.checkpoint.endpoints import HFSource, pick_bridge, read_hf_config
from mindspeed_llm.checkpoint.megatron_legacy import TRACKER, checkpoint_args, iteration_dir, model_keys, rank_dir
from mindspeed_llm.tokenizer import load_tokenizer
from mindspeed_llm.training.config import ModelConfig, PretrainConfig
from mindspeed_llm.training.lora_io import save_lora_adapter
from mindspeed_llm.training.model import unwrap

logger = get_logger(__name__)

#: ModelShape field -> ModelConfig field, for the fields that carry over one to one.
_SHAPE_TO_MODEL = {
    "num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels", "vocab_size": "vocab_size", "norm_epsilon": "norm_epsilon",
    "rotary_base": "rotary_base", "use_rope_scaling": "rope_scaling", "rope_scaling_factor": "rope_scaling_factor",
    "add_qkv_bias": "add_qkv_bias", "qk_layernorm": "qk_layernorm", "num_experts": "num_moe_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size", "moe_router_topk": "moe_router_topk",
}


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
    known = [a for a in raw.get("architectures") or [] if a in bridge.hf_architectures]
    return bridge, bridge.shape_from_hf(config), (known[0] if known else bridge.hf_architectures[0])


#: ModelShape fields with no ModelConfig field, passed to megatron through ``model.megatron``
#: (MLA, DeepSeek's router, dense layers between MoE layers, shared experts).
_MOE_FIELDS = ("moe_router_pre_softmax", "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias",
               "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_topk_scaling_factor")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
               "rotary_base", "rotary_scaling_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow",
               "original_max_position_embeddings")


def shape_megatron_fields(shape: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``shape`` that the recipe's ``model`` section has no field for."""
    fields: dict[str, Any] = {}
    if shape.num_experts:
        fields.update({name: getattr(shape, name) for name in _MOE_FIELDS if getattr(shape, name) is not None})
        fields["moe_layer_freq"] = list(shape.moe_layer_freq)
    if shape.multi_latent_attention:
        fields.update(multi_latent_attention=True, **{name: getattr(shape, name) for name in _MLA_FIELDS})
    return fields


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
    default, model = ModelConfig(), config.model
    values = {dst: getattr(shape, src) for src, dst in _SHAPE_TO_MODEL.items()}
    values.update(tie_embeddings=shape.tie_embeddings, normalization="RMSNorm", swiglu=True,
                  position_embedding_type="rope", add_bias_linear=False)
    for key, value in values.items():
        mine = getattr(model, key)
        if mine != getattr(default, key) and mine != value:
            raise ConfigError(f"model.{key}={mine!r} contradicts checkpoint.load_hf's config ({value!r}); remove it "
                              "from the recipe")
    megatron = shape_megatron_fields(shape) | dict(model.megatron)
    divisible = 1 if model.make_vocab_size_divisible_by == default.make_vocab_size_divisible_by else \
        model.make_vocab_size_divisible_by
    new_model = dataclasses.replace(model, **values, megatron=megatron, make_vocab_size_divisible_by=divisible)
    data = config.data
    if not data.tokenizer and any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
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
    p, m = config.parallel, config.model
    return ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, vpp_layers=m.num_layers // (p.pp * p.vpp) if p.vpp else None)


def _my_rank() -> Any:
    from megatron.core import parallel_state as ps


    return RankKey(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                   ps.get_expert_model_parallel_rank())


def _vocab_pieces(full: torch.Tensor, rows: int, tp: int) -> list[torch.Tensor]:
    if full.shape[0] < rows:
        full = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))])
    return list(full.chunk(tp, dim=0))


def load_hf_weights(chunks: list[Any], config: PretrainConfig, path: str | Path, vocab_rows: int) -> None:
    """Load this rank's pieces of the Hugging Face weights in ``path`` into ``chunks`` (collective).

    Raises:
        ConfigError: the directory's tensors do not match its config, or leave a parameter of
            this rank's model unset.
    """
    try:
        source = HFSource(Path(path))
        plan = plan_conversion(source.bridge, source.shape, source.hf_shapes())
    except ValueError as err:
        raise ConfigError(f"checkpoint.load_hf: {err}") from err
    layout, me = _layout(config), _my_rank()
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
            parts = (_vocab_pieces(full, vocab_rows, layout.tp) if param.split is Split.VOCAB
                     else split_tensor(param, full, layout.tp))
            for piece in mine:
                target = states[piece.chunk].get(piece.name)
                if target is None or tuple(target.shape) != tuple(parts[piece.tp_index].shape):
                    got = None if target is None else tuple(target.shape)
                    raise ConfigError(f"checkpoint.load_hf: {task.mg_name} does not fit this rank's model "
                                      f"({piece.name}: model {got}, checkpoint {tuple(parts[piece.tp_index].shape)})")
                target.copy_(parts[piece.tp_index])
                loaded.add((piece.chunk, piece.name))
    missing = sorted(name for _, name in expected - loaded)
    if missing:
        raise ConfigError(f"checkpoint.load_hf: {path} leaves these parameters of the model unset: {missing[:6]}")
    logger.info("loaded %d tensors of %s (%s) into this rank's model", len(loaded), path, source.bridge.family)


def _infer_family(model: ModelConfig) -> str:
    if model.normalization != "RMSNorm" or not model.swiglu or model.add_bias_linear or \
            model.position_embedding_type != "rope":
        raise ConfigError("checkpoint.save_hf needs a Llama-style model (RMSNorm, swiglu, rope, no linear biases)")
    if model.num_moe_experts:
        return "qwen3-moe" if model.qk_layernorm else "mixtral"
    if model.qk_layernorm:
        return "qwen3"
    return "qwen25" if model.add_qkv_bias else "llama2"


def model_shape(config: PretrainConfig, vocab_size: int) -> Any:
    """The :class:`~mindspeed_llm.bridges.ModelShape` of the recipe's model (for export)."""
    m = config.model
    values = {src: getattr(m, dst) for src, dst in _SHAPE_TO_MODEL.items()}
    values.update(
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size, num_query_groups=m.num_query_groups or m.num_attention_heads,
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads, vocab_size=vocab_size,
        max_position_embeddings=m.max_position_embeddings or config.data.seq_length,
        untie_embeddings_and_output_weights=not m.tie_embeddings,
        params_dtype="bfloat16" if config.train.precision == "bf16" else "float32",
    )
    if m.num_moe_experts:
        values.update(moe_ffn_hidden_size=m.moe_ffn_hidden_size or values["ffn_hidden_size"],
                      moe_layer_freq=(1,) * m.num_layers,
                      moe_router_pre_softmax=bool(m.megatron.get("moe_router_pre_softmax", False)))
    else:
        values.update(num_experts=None, moe_ffn_hidden_size=None)
    return ModelShape(**values)


def export_shape(config: PretrainConfig, vocab_size: int) -> tuple[Any, Any, str, Path | None]:
    """``(bridge, shape, architecture, assets)`` of the trained model for export.

    From ``checkpoint.load_hf`` when the run started there (its config and tokenizer files are
    the assets), else from the recipe's model (a family inferred from its options).
    """
    dtype = "bfloat16" if config.train.precision == "bf16" else "float32"
    if config.checkpoint.load_hf:
        bridge, shape, architecture = read_hf_shape(config.checkpoint.load_hf)
        return bridge, dataclasses.replace(shape, params_dtype=dtype), architecture, Path(config.checkpoint.load_hf)

    bridge = bridge_for_family(_infer_family(config.model))
    return bridge, model_shape(config, vocab_size), bridge.hf_architectures[0], None


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
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()
             if not name.endswith("_extra_state") and not is_lora_key(name)}
    dtype = next(p for p in model.parameters()).dtype
    for name, module in model.named_modules():
        if hasattr(module, "dequantized_weight"):
            state[f"{name}.weight"] = module.dequantized_weight(dtype).detach().cpu()
    if tp == 1:  # one piece: drop the padding rows here (several pieces are glued, then cut)
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in state:
                state[name] = state[name][:vocab_size].clone()
    return state


def save_hf(chunks: list[Any], config: PretrainConfig, step: int, vocab_size: int, vocab_rows: int,
            lora: Any = None) -> Path:
    """Write the model as a Hugging Face directory at ``checkpoint.save_hf`` (collective).

    Args:
        chunks: this rank's model chunks.
        config: the recipe.
        step: recorded as the iteration.
        vocab_size: the tokenizer's vocabulary (the Hugging Face embedding rows).
        vocab_rows: the padded rows of the megatron embedding.
        lora: the run's ``LoraSettings``: the adapter is merged into the exported weights (in
            float32 math, stored in the weights' dtype).
    """
    target = Path(config.checkpoint.save_hf)
    bridge, shape, architecture, assets = export_shape(config, vocab_size)
    layout = _layout(config)
    staging = target.with_name(target.name + ".megatron-tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    from megatron.core import parallel_state as ps

    # One writer per (tp, pp, ep) piece: with expert parallelism the expert ranks > 0 sit at
    # data-parallel ranks > 0 (their dense weights are the data-parallel replicas' own).
    writer = ps.get_expert_data_parallel_rank() == 0 if layout.ep > 1 else ps.get_data_parallel_rank() == 0
    if writer:
        args = checkpoint_args(shape, layout, bridge.family, architecture, vocab_rows, iteration=step)
        keys = model_keys(len(chunks))
        state = {"args": args, "checkpoint_version": 3.0, "iteration": step}
        for key, chunk in zip(keys, chunks):
            state[key] = _export_state(chunk, vocab_size, layout.tp)
        folder = staging / iteration_dir(step) / rank_dir(_my_rank(), layout)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "model_optim_rng.pt")
    dist.barrier()
    adapter = None
    if lora is not None:
        adapter = staging.with_name(staging.name + "-lora")
        save_lora_adapter(chunks, adapter, shape, None, lora)
    if rank0:
        try:
            (staging / TRACKER).write_text(f"{step}\n")
            with logged_as_detail("mindspeed_llm.checkpoint.convert"):  # its report is the run log's
                convert_checkpoint(ConvertConfig(load_model_type="mg", save_model_type="hf", load_dir=staging,
                                                 save_dir=target, hf_cfg_dir=assets, overwrite=True, progress=False,
                                                 lora_load=adapter))
            if assets is None and config.data.tokenizer:
                load_tokenizer(config.data.tokenizer).save_pretrained(str(target))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if adapter is not None:
                shutil.rmtree(adapter, ignore_errors=True)
        logger.info("saved the model as a Hugging Face directory: %s", target)
    dist.barrier()
    return target
