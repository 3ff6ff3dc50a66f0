"""What auto-settings searches for: the training job (from a recipe's plain mapping) and the cluster.

The core does not import the LLM suite, so the model is read from the recipe as plain data: the
``model``, ``data``, ``train``, ``parallel`` and ``features`` sections of a ``mindspeed-llm``
recipe (the keys are the recipe's own; see ``docs/llm/pretrain.md``). Every missing or
inconsistent value is a ``ValueError`` naming the key and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mindspeed.model.shape import ModelShape

#: Recipe ``model`` key -> :class:`ModelShape` field, for the keys that carry over one to one.
_SHAPE_KEYS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "swiglu": "swiglu",
    "normalization": "normalization",
    "num_moe_experts": "num_experts",
    "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "qk_layernorm": "qk_layernorm",
}
_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class JobSpec:
    """The training job auto-settings lays out.

    Attributes:
        shape: the model (vocabulary unpadded).
        seq_length: tokens per sequence.
        global_batch_size: sequences per optimizer step (fixed over the search).
        precision: ``fp32`` or ``bf16`` (bf16 weights with fp32 masters and fp32 gradient buffers).
        make_vocab_size_divisible_by: the embedding is padded to a multiple of this and of tp.
        flash_attention: the attention kernel keeps ``O(s)`` memory (flash, SDPA, the NPU's
            fused kernel: the default); false: the score matrices are kept (``O(s^2)``).
        recipe: the recipe as read (the search's overrides are merged into it).
    """

    shape: ModelShape
    seq_length: int
    global_batch_size: int
    precision: str = "fp32"
    make_vocab_size_divisible_by: int = 128
    flash_attention: bool = True
    recipe: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one weight / activation element."""
        return 2 if self.precision == "bf16" else 4

    def padded_vocab(self, tp: int) -> int:
        """The embedding rows megatron allocates at tensor-parallel size ``tp``."""
        multiple = math.lcm(self.make_vocab_size_divisible_by, tp)
        return -(-self.shape.vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ClusterSpec:
    """The machines: how many, how much device memory, how fast.

    Attributes:
        nnodes: nodes.
        nproc_per_node: devices per node.
        device_memory_bytes: usable memory of one device.
        peak_tflops: dense peak TFLOP/s of one device at the job's precision.
        link_gbps: bandwidth of one device's links inside a node, GB/s (between nodes a
            quarter of it is assumed, as for one NIC per device against NVLink/HCCS).
        host_gbps: device <-> host copy bandwidth, GB/s (swaps).
        memory_gbps: the device memory's bandwidth, GB/s (element-wise recompute, the optimizer).
        mfu: the fraction of the peak a well-shaped matmul reaches (the model is relative, so
            this scales every time alike).
        async_copies: swaps overlap with compute (a side stream); false on the CPU.
        latency_s: fixed cost of one collective or point-to-point call.
    """

    nnodes: int
    nproc_per_node: int
    device_memory_bytes: int
    peak_tflops: float = 312.0
    link_gbps: float = 200.0
    host_gbps: float = 25.0
    memory_gbps: float = 2000.0
    mfu: float = 0.5
    async_copies: bool = True
    latency_s: float = 1e-5

    @property
    def world_size(self) -> int:
        """Devices in all."""
        return self.nnodes * self.nproc_per_node


def _section(recipe: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = recipe.get(name) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"recipe section {name!r} must be a mapping, got {type(value).__name__}")
    return value


def _positive_int(section: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{section}.{key}={value!r} must be a positive integer; fix it in the recipe")
    return value


def job_from_recipe(recipe: Mapping[str, Any], world_size: int | None = None) -> JobSpec:
    """The :class:`JobSpec` of a ``mindspeed-llm`` recipe given as a plain mapping (a loaded YAML).

    Args:
        recipe: the recipe.
        world_size: devices of the target cluster; with ``train.global_batch_size`` unset the
            batch is ``train.micro_batch_size x world_size`` (what the recipe trains on that
            many devices without model parallelism).

    Raises:
        ValueError: a missing or bad value, named by its recipe key.
    """
    if not isinstance(recipe, Mapping):
        raise ValueError("the recipe must hold a mapping at the top level (sections model, data, train, ...)")
    model, data, train = _section(recipe, "model"), _section(recipe, "data"), _section(recipe, "train")
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if key not in model:
            raise ValueError(f"model.{key} is missing from the recipe; auto-settings needs the model's shape")
        _positive_int("model", key, model[key])
    vocab = model.get("vocab_size")
    if vocab is None:
        raise ValueError("model.vocab_size is unset; set it in the recipe (auto-settings reads no tokenizer)")
    _positive_int("model", "vocab_size", vocab)
    values = {theirs: model[mine] for mine, theirs in _SHAPE_KEYS.items() if model.get(mine) is not None}
    ffn = model.get("ffn_hidden_size") or 4 * model["hidden_size"]
    values.update(
        ffn_hidden_size=_positive_int("model", "ffn_hidden_size", ffn),
        vocab_size=vocab,
        untie_embeddings_and_output_weights=not model.get("tie_embeddings", False),
    )
    if values.get("num_experts") and not values.get("moe_ffn_hidden_size"):
        values["moe_ffn_hidden_size"] = ffn
    try:
        shape = ModelShape(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"model section: {err}") from err
    if model.get("kv_channels") is None and shape.hidden_size % shape.num_attention_heads:
        raise ValueError(
            f"model.hidden_size={shape.hidden_size} is not divisible by model.num_attention_heads="
            f"{shape.num_attention_heads}; set model.kv_channels"
        )
    if shape.num_attention_heads % shape.num_query_groups:
        raise ValueError(
            f"model.num_attention_heads={shape.num_attention_heads} is not divisible by "
            f"model.num_query_groups={shape.num_query_groups}"
        )
    seq = _positive_int("data", "seq_length", data.get("seq_length", 128))
    precision = train.get("precision", "fp32")
    if precision not in _PRECISIONS:
        raise ValueError(f"train.precision={precision!r} is not one of {', '.join(_PRECISIONS)}")
    micro = _positive_int("train", "micro_batch_size", train.get("micro_batch_size", 1))
    gbs = train.get("global_batch_size")
    if gbs is None:
        gbs = micro * (world_size or 1)
    gbs = _positive_int("train", "global_batch_size", gbs)
    settings = _section(_section(recipe, "features"), "settings")
    flash = settings.get("flash_attn")
    math_attention = isinstance(flash, Mapping) and flash.get("impl") == "reference"
    return JobSpec(
        shape=shape,
        seq_length=seq,
        global_batch_size=gbs,
        precision=precision,
        make_vocab_size_divisible_by=_positive_int(
            "model", "make_vocab_size_divisible_by", model.get("make_vocab_size_divisible_by", 128)
        ),
        flash_attention=not math_attention,
        recipe=recipe,
    )


def parse_device(text: str) -> tuple[float, float, float | None]:
    """``PEAK_TFLOPS,LINK_GBPS[,HOST_GBPS]`` of ``--device``.

    Raises:
        ValueError: not two or three positive numbers.
    """
    parts = [p.strip() for p in text.split(",")]
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3) or any(not (x > 0 and math.isfinite(x)) for x in numbers):
        raise ValueError(
            f"--device {text!r} must be PEAK_TFLOPS,LINK_GBPS[,HOST_GBPS] (positive numbers), e.g. 989,450"
        )
    return numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else None
