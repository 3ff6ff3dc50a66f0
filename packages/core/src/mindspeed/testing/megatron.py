"""A tiny megatron-core GPT on any parallel layout, and its comparison with the unsharded run.

The proof that megatron-core runs correctly on an accelerator (the CPU with gloo included) is
that every parallel layout reproduces the single-rank run of the same model: same weights,
same data, same loss and gradients. This module holds the pieces such tests share:

- :class:`TinyGPTConfig` (a :class:`~mindspeed.model.ModelShape` with tiny defaults) and
  :class:`~mindspeed.megatron.config.ParallelSizes`: the model and the layout, as typed values;
  megatron's ``TransformerConfig`` comes from the core's one builder
  (:func:`mindspeed.megatron.config.transformer_config`).
- :func:`init_parallel` / :func:`destroy_parallel`: megatron's ``parallel_state`` and RNG.
- :func:`build_gpt`: the model chunks of this rank (one per virtual pipeline stage), wrapped in
  megatron's ``DistributedDataParallel`` with ``finalize_model_grads`` and ``no_sync`` set.
- :func:`param_shards`: every local parameter with its global name and the function that cuts
  the matching piece out of the full tensor (layer offset of pipeline stages, tensor-parallel
  slices along ``partition_dim`` with ``partition_stride``, expert-parallel expert indices).
  :func:`load_full_state` and :func:`compare_with_full` are built on it.
- :func:`run_forward_backward`: one pass of megatron's own ``get_forward_backward_func()``;
  :func:`train_step` adds the optimizer step.
- :func:`run_reference` / :func:`check_layout`: the single-rank run, and one layout compared
  with it (loss and every gradient) into a :class:`Comparison`; :func:`merge_summaries`
  joins the ranks' reports.
- MoE: :func:`grouped_expert_state` (a SequentialMLP state in the grouped-experts layout),
  :func:`train_steps` (several steps with megatron's auxiliary losses, :func:`read_aux_losses`),
  :func:`split_microbatches` and :func:`expert_biases`.

Every function assumes megatron-core has been adapted (``mindspeed.megatron.adapt()``) and
torch.distributed is initialised.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.megatron import fast_path
from mindspeed.megatron.config import ParallelSizes, transformer_config
from mindspeed.metrics.moe import read_aux_losses
from mindspeed.model.shape import ModelShape

#: Layer index in megatron's local parameter names (``decoder.layers.<i>.``).
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
#: Local expert index in a SequentialMLP (``experts.local_experts.<j>.``).
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
#: The two weights of grouped experts (megatron's GroupedMLP layout, RegistryGroupedMLP).
_GROUPED_EXPERTS = re.compile(r"\.experts\.weight([12])$")


@dataclass(frozen=True, kw_only=True)
class TinyGPTConfig(ModelShape):
    """The tiny GPT: a :class:`~mindspeed.model.ModelShape` with tiny defaults (Llama-like: RMSNorm,
    SwiGLU, rope, GQA, no bias, fp32) and the three settings of a test run.

    Attributes:
        seq_length: tokens per sequence (divisible by tp when sequence parallel).
        moe_token_dispatcher_type: ``"alltoall"`` or ``"allgather"``.
        seed: seed of the weights and of megatron's RNG tracker.

    The shape's defaults: 4 layers (divisible by pp * vpp of every layout it runs on), width 64,
    MLP width 128 (per expert for MoE), 4 query heads in 2 groups, a vocabulary of 128
    (divisible by the tensor-parallel size), untied, RMSNorm epsilon 1e-5.
    """

    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = 2
    vocab_size: int = 128
    norm_epsilon: float = 1e-5
    seq_length: int = 32
    moe_token_dispatcher_type: str = "alltoall"
    seed: int = 1234


def init_parallel(sizes: ParallelSizes, seed: int = 1234) -> None:
    """Initialise megatron's parallel state for ``sizes`` and seed its RNG tracker.

    Args:
        sizes: the layout; ``tp * pp * ep`` must divide the world size.
        seed: seed given to ``model_parallel_cuda_manual_seed`` (and the default generator).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Undo :func:`init_parallel` (process groups of the next layout are created afresh)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def build_gpt(
    model: TinyGPTConfig, sizes: ParallelSizes, ddp_config: Any = None, layer_spec: Any = None, **config_overrides: Any
) -> list[Any]:
    """This rank's model chunks of the tiny GPT, each wrapped in megatron's DDP.

    The wrapper is there for every layout, the single-rank one included, because
    ``finalize_model_grads`` (set here as the config's ``finalize_model_grads_func``, with
    ``no_sync_func``) is what all-reduces data-parallel, sequence-parallel norm and tied
    embedding gradients; without it data-parallel ranks silently diverge.

    Args:
        model: the model shape.
        sizes: the layout, already initialised with :func:`init_parallel`.
        ddp_config: a ``DistributedDataParallelConfig`` (default: no overlap, no distributed optimizer).
        layer_spec: the transformer-layer ``ModuleSpec`` (default: megatron's local spec with
            ``SequentialMLP`` experts; for ``position_embedding_type="alibi"`` the registry spec
            with ALiBi in its core attention).
        **config_overrides: extra ``TransformerConfig`` fields.

    Returns:
        One DDP-wrapped ``GPTModel`` per virtual pipeline stage (one without interleaving).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    # A zero auxiliary-loss coefficient (the builder's default) keeps the loss the plain LM loss,
    # so layouts compare exactly; megatron's local spec calls its own activation function.
    config_overrides.setdefault("use_te_activation_func", False)
    if model.num_experts:  # megatron's default balancing (its losses are tracked; the coefficient is 0)
        config_overrides.setdefault("moe_router_load_balancing_type", "aux_loss")
    config = transformer_config(
        model, sizes, moe_token_dispatcher_type=model.moe_token_dispatcher_type, **config_overrides
    )
    alibi = model.position_embedding_type == "alibi"
    if layer_spec is None and alibi:  # ALiBi lives in the registry's core attention
        from mindspeed.megatron.spec import get_gpt_layer_spec

        layer_spec = get_gpt_layer_spec(num_experts=model.num_experts, moe_grouped_gemm=False, swiglu=False, alibi=True)
    spec = layer_spec or get_gpt_layer_local_spec(
        num_experts=model.num_experts, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    ddp_config = ddp_config or DistributedDataParallelConfig()
    chunks = []
    for stage in range(sizes.vpp or 1):
        vp_stage = stage if sizes.vpp else None
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model.vocab_size,
            max_sequence_length=model.seq_length,
            position_embedding_type="none" if alibi else "rope",
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=model.tie_embeddings,
            vp_stage=vp_stage,
        )
        if config.bf16 or config.fp16:  # half-precision weights: megatron casts inputs and outputs
            gpt = Float16Module(config, gpt)
        # Megatron's training loop buckets only the first chunk's gradients; the others use one bucket.
        chunks.append(DistributedDataParallel(config, ddp_config, gpt, disable_bucketing=stage > 0))
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    return chunks


@dataclass
class ParamShard:
    """One local parameter, its name in the single-rank model, and how to cut it from there.

    Attributes:
        name: the parameter's name in the unsharded single-rank model.
        param: the local parameter.
        take: ``take(full_tensor) -> local piece`` (same shape as ``param``).
    """

    name: str
    param: torch.nn.Parameter
    take: Callable[[torch.Tensor], torch.Tensor]


def unwrap(chunk: Any) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP and ``Float16Module`` wrappers (or the module itself)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _tp_slicer(param: torch.Tensor, rank: int, size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return lambda full: full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)

    def take(full: torch.Tensor) -> torch.Tensor:
        # Megatron's own rule (``_initialize_affine_weight_cpu``): split the full tensor into
        # ``stride * size`` equal blocks and give rank r blocks r, r + size, ... With stride 2
        # this is why a SwiGLU linear_fc1 rank holds [gate_r; up_r], not a slice of [gate; up].
        blocks = torch.split(full, full.shape[dim] // (size * stride), dim=dim)
        return torch.cat(blocks[rank::size], dim=dim)

    return take


def param_shards(chunks: list[Any], model: TinyGPTConfig) -> list[ParamShard]:
    """Every local parameter of ``chunks`` with its single-rank name and slicer.

    Args:
        chunks: this rank's model chunks (DDP-wrapped or not).
        model: the model shape (for the number of experts).

    Returns:
        The shards, in the chunks' parameter order.
    """
    from megatron.core import parallel_state as ps

    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    ep_rank, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    shards = []
    for chunk in chunks:
        gpt = unwrap(chunk)
        for local_name, param in gpt.named_parameters():
            name = local_name
            layer = _LAYER.match(name)
            if layer:
                # Local layer i of a pipeline stage is global layer layer_number - 1.
                number = gpt.decoder.layers[int(layer.group(1))].layer_number
                name = f"decoder.layers.{number - 1}." + name[layer.end() :]
            expert = _EXPERT.search(name)
            if expert:
                # Local expert j on expert-parallel rank r is global expert r * E / ep + j.
                index = ep_rank * (model.num_experts // ep_size) + int(expert.group(1))
                name = name[: expert.start()] + f".experts.local_experts.{index}." + name[expert.end() :]
            grouped = _GROUPED_EXPERTS.search(name)
            if grouped:
                # Grouped experts hold all local experts in one tensor: cut experts, then ETP.
                take = _grouped_slicer(
                    int(grouped.group(1)), model.num_experts, ep_rank, ep_size, *etp, gated=gpt.config.gated_linear_unit
                )
                shards.append(ParamShard(name, param, lambda full, take=take, shape=param.shape: take(full, shape)))
                continue
            if name == "output_layer.weight" and model.tie_embeddings:
                # The last stage's copy of the tied embedding.
                name = "embedding.word_embeddings.weight"
            rank, size = etp if expert else tp
            shards.append(ParamShard(name, param, _tp_slicer(param, rank, size)))
    return shards


def full_state(chunks: list[Any]) -> dict[str, torch.Tensor]:
    """Parameters of an unsharded (single-rank layout) model, cloned, by name."""
    return {name: param.detach().clone() for chunk in chunks for name, param in unwrap(chunk).named_parameters()}


def full_grads(chunks: list[Any]) -> dict[str, torch.Tensor]:
    """Reduced gradients (``main_grad`` of megatron's DDP) of an unsharded model, cloned, by name."""
    return {name: local_grad(param).clone() for chunk in chunks for name, param in unwrap(chunk).named_parameters()}


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient megatron's optimizer would read: ``main_grad`` under DDP, else ``grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def load_full_state(chunks: list[Any], model: TinyGPTConfig, state: dict[str, torch.Tensor]) -> None:
    """Copy the single-rank model's parameters into this rank's (sharded) chunks.

    Args:
        chunks: this rank's model chunks.
        model: the model shape.
        state: :func:`full_state` of the single-rank model.

    Raises:
        KeyError: a local parameter has no counterpart in ``state``.
        ValueError: a slice does not have the local parameter's shape.
    """
    with torch.no_grad():
        for shard in param_shards(chunks, model):
            if shard.name not in state:
                raise KeyError(f"{shard.name} is not in the single-rank state (known: {sorted(state)})")
            piece = shard.take(state[shard.name])
            if piece.shape != shard.param.shape:
                raise ValueError(f"{shard.name}: slice {tuple(piece.shape)} != local {tuple(shard.param.shape)}")
            shard.param.copy_(piece)


@dataclass
class Comparison:
    """Differences between one layout's tensors and the reference's, for a readable report.

    Attributes:
        layout: the label of what was compared.
        atol: absolute tolerance.
        rtol: relative tolerance (of the reference value).
        max_abs: largest absolute difference seen.
        worst: the tensor with the largest absolute difference.
        names: everything compared, in order.
        diffs: the largest absolute difference of each compared name.
        failures: ``"name: detail"`` for every tensor outside the tolerance.
        extra: more plain data for the report (schedule, optimizer, ...).
    """

    layout: str
    atol: float = 1e-5
    rtol: float = 1e-4
    max_abs: float = 0.0
    worst: str = ""
    names: list[str] = field(default_factory=list)
    diffs: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(
        self,
        name: str,
        actual: torch.Tensor | float,
        expected: torch.Tensor | float,
        atol: float | None = None,
        rtol: float | None = None,
    ) -> None:
        """Compare one tensor (or number) with its reference value (tolerances default to the object's)."""
        atol = self.atol if atol is None else atol
        rtol = self.rtol if rtol is None else rtol
        actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
        self.names.append(name)
        if actual.shape != expected.shape:
            self.failures.append(f"{name}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
            return
        diff = (actual - expected).abs()
        biggest = diff.max().item() if diff.numel() else 0.0
        self.diffs[name] = biggest
        if biggest >= self.max_abs:
            self.max_abs, self.worst = biggest, name
        excess = diff - (atol + rtol * expected.abs())
        if diff.numel() and (excess.max().item() > 0 or not torch.isfinite(actual).all()):
            self.failures.append(f"{name}: max |diff| {biggest:.3g} (atol {atol:g}, rtol {rtol:g})")

    def summary(self) -> dict[str, Any]:
        """Plain data (picklable across ranks)."""
        return {
            "layout": self.layout,
            "max_abs": self.max_abs,
            "worst": self.worst,
            "names": list(self.names),
            "diffs": dict(self.diffs),
            "failures": list(self.failures),
            **self.extra,
        }


def merge_summaries(per_rank: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Combine the ranks' :meth:`Comparison.summary` lists into one entry per layout.

    Args:
        per_rank: what each rank returned (a list of summaries, one per layout, same order).

    Returns:
        ``{layout: {"max_abs", "worst", "names" (union), "diffs" (largest per name), "failures"
        (with the rank), ...}}``; other keys are taken from rank 0.
    """
    merged: dict[str, dict[str, Any]] = {}
    for rank, summaries in enumerate(per_rank):
        for item in summaries:
            entry = merged.setdefault(
                item["layout"], {**item, "max_abs": 0.0, "names": set(), "diffs": {}, "failures": []}
            )
            if item["max_abs"] >= entry["max_abs"]:
                entry["max_abs"], entry["worst"] = item["max_abs"], f"rank {rank}: {item['worst']}"
            entry["names"] |= set(item["names"])
            for name, diff in item["diffs"].items():
                entry["diffs"][name] = max(diff, entry["diffs"].get(name, 0.0))
            entry["failures"] += [f"rank {rank}: {failure}" for failure in item["failures"]]
    return merged


def compare_with_full(
    chunks: list[Any],
    model: TinyGPTConfig,
    reference: dict[str, torch.Tensor],
    comparison: Comparison,
    read: Callable[[torch.Tensor], torch.Tensor] = local_grad,
    prefix: str = "grad",
) -> None:
    """Compare every local parameter's ``read(param)`` with its slice of ``reference``.

    Args:
        chunks: this rank's model chunks.
        model: the model shape.
        reference: full tensors by single-rank name (:func:`full_grads` or :func:`full_state`).
        comparison: where differences are recorded.
        read: what to compare (default: the reduced gradient; pass ``lambda p: p`` for values).
        prefix: label prefix in the report.
    """
    for shard in param_shards(chunks, model):
        comparison.add(f"{prefix} {shard.name}", read(shard.param).detach(), shard.take(reference[shard.name]))


def make_batches(
    model: TinyGPTConfig, num_microbatches: int, micro_batch_size: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Random token microbatches (the same on every rank for the same seed).

    Returns:
        ``num_microbatches`` dicts with ``tokens``, ``labels`` and ``position_ids`` of shape
        ``[micro_batch_size, seq_length]``.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (num_microbatches, micro_batch_size, model.seq_length + 1)
    ids = torch.randint(0, model.vocab_size, shape, generator=gen)
    positions = torch.arange(model.seq_length).expand(micro_batch_size, -1)
    return [
        {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(), "position_ids": positions}
        for seq in ids
    ]


def shard_batches(batches: list[dict[str, torch.Tensor]], dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's rows of every microbatch (equal shares, in rank order)."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        share = t.shape[0] // dp_size
        return t[dp_rank * share : (dp_rank + 1) * share]

    return [{key: rows(value) for key, value in batch.items()} for batch in batches]


def local_batches(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """This rank's share of ``batches`` under the current layout's data-parallel group."""
    from megatron.core import parallel_state as ps

    return shard_batches(batches, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())


def train_step(chunks: list[Any], optimizer: Any, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """One training step: megatron's schedule on ``batches`` (this rank's share), then ``optimizer.step()``.

    Returns:
        The whole batch's loss (:func:`global_loss`) and the gradient norm the optimizer clipped with.

    Raises:
        RuntimeError: the optimizer skipped the step (non-finite gradients).
    """
    optimizer.zero_grad()
    loss = global_loss(run_forward_backward(chunks, batches))
    with fast_path():  # as the trainer runs it: without the device redirect
        ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("the optimizer skipped the step (non-finite gradients)")
    return loss, float(grad_norm)


def _loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = per_token.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Callable]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, _loss_func


def run_forward_backward(
    chunks: list[Any], batches: list[dict[str, torch.Tensor]], forward_only: bool = False
) -> float | None:
    """One pass of megatron's schedule for the current layout over ``batches``.

    The schedule divides each microbatch's loss by the number of microbatches before the
    backward, so the gradients are those of the mean loss; megatron's DDP then averages over
    data-parallel ranks, so equal data shares give the gradients of the full-batch mean.

    Args:
        chunks: this rank's model chunks (from :func:`build_gpt`).
        batches: the microbatches this rank consumes (every pipeline stage gets the same list).
        forward_only: skip the backward (evaluation).

    Returns:
        The mean microbatch loss on the last pipeline stage, ``None`` on the others.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        for chunk in chunks:
            chunk.zero_grad_buffer()
    micro_batch_size, seq_length = batches[0]["tokens"].shape
    with fast_path():  # as the trainer runs it: without the device redirect
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=len(batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
    if not losses:
        return None
    return torch.stack([item["lm loss"] for item in losses]).mean().item()


def global_loss(loss: float | None) -> float:
    """The loss of the whole batch: from the last pipeline stage, averaged over data-parallel ranks."""
    from megatron.core import parallel_state as ps

    value = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
    dist.all_reduce(value, group=ps.get_pipeline_model_parallel_group())
    # gloo has no AVG reduction: sum and divide.
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return value.item() / ps.get_data_parallel_world_size()


@dataclass
class Reference:
    """The single-rank run: parameters, reduced gradients and loss, by single-rank name."""

    state: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    loss: float


def run_reference(model: TinyGPTConfig, batches: list[dict[str, torch.Tensor]], **config_overrides: Any) -> Reference:
    """Forward and backward of the unsharded model (all sizes 1) on the full batch, on every rank.

    Every rank runs the same model (rank 0's weights) on the same data, so the data-parallel
    average that megatron's DDP takes over the world is an average of identical gradients:
    exactly the single-rank gradients.

    Args:
        model: the model shape.
        batches: the full microbatches.
        **config_overrides: extra ``TransformerConfig`` fields.

    Returns:
        The reference (parallel state is destroyed again on return).
    """
    init_parallel(ParallelSizes(), model.seed)
    try:
        chunks = build_gpt(model, ParallelSizes(), **config_overrides)
        broadcast_state(chunks)
        loss = global_loss(run_forward_backward(chunks, batches))
        return Reference(full_state(chunks), full_grads(chunks), loss)
    finally:
        destroy_parallel()


def check_layout(
    model: TinyGPTConfig,
    sizes: ParallelSizes,
    batches: list[dict[str, torch.Tensor]],
    reference: Reference,
    label: str | None = None,
    ddp_config: Any = None,
    **config_overrides: Any,
) -> dict[str, Any]:
    """Run ``sizes`` from the reference's weights and compare loss and gradients with it.

    Each data-parallel rank takes its equal share of every microbatch (:func:`shard_batches`).

    Args:
        model: the model shape.
        sizes: the layout under test.
        batches: the full microbatches (the reference's).
        reference: :func:`run_reference`'s result.
        label: the layout's name in the report (default ``sizes.name``).
        ddp_config: a ``DistributedDataParallelConfig`` for the layout.
        **config_overrides: extra ``TransformerConfig`` fields.

    Returns:
        This rank's :meth:`Comparison.summary`, with the schedule's name under ``"schedule"``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_parallel(sizes, model.seed)
    try:
        chunks = build_gpt(model, sizes, ddp_config, **config_overrides)
        load_full_state(chunks, model, reference.state)
        local = local_batches(batches)
        comparison = Comparison(label or sizes.name)
        comparison.extra["schedule"] = get_forward_backward_func().__name__
        # Both losses are fp32 means of the same per-token losses, summed in another order.
        comparison.add("loss", global_loss(run_forward_backward(chunks, local)), reference.loss, atol=1e-5, rtol=1e-6)
        compare_with_full(chunks, model, reference.grads, comparison)
        return comparison.summary()
    finally:
        destroy_parallel()


def broadcast_state(chunks: list[Any]) -> None:
    """Make every rank's parameters rank 0's (the reference model must be identical everywhere)."""
    with torch.no_grad():
        for chunk in chunks:
            for param in unwrap(chunk).parameters():
                dist.broadcast(param.data, src=0)


# -- MoE: grouped experts, and training several steps with auxiliary losses ---------------------


def _grouped_slicer(
    which: int, num_experts: int, ep_rank: int, ep_size: int, etp_rank: int, etp_size: int, gated: bool
) -> Callable[[torch.Tensor, torch.Size], torch.Tensor]:
    local = num_experts // ep_size
    experts = slice(ep_rank * local, (ep_rank + 1) * local)

    def take(full: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        # weight1 [hidden, E * F] holds [E, hidden, F] (F = [gate | up] when gated) and weight2
        # [E * ffn, hidden] holds [E, ffn, hidden]; an ETP rank r has blocks r (and r + etp of a
        # gated F) of every expert, as megatron's GroupedMLP.sharded_state_dict reads them.
        if which == 1:
            view, dim, stride = full.reshape(num_experts, full.shape[0], -1)[experts], 2, 2 if gated else 1
        else:
            view, dim, stride = full.reshape(num_experts, -1, full.shape[1])[experts], 1, 1
        blocks = torch.split(view, view.shape[dim] // (etp_size * stride), dim=dim)
        return torch.cat(blocks[etp_rank::etp_size], dim=dim).reshape(shape)

    return take


_SEQUENTIAL_FC = re.compile(r"^((?:.*\.)?experts)\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def grouped_expert_state(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """A single-rank state of a ``SequentialMLP`` model with its experts in the grouped layout.

    ``experts.local_experts.<e>.linear_fc1.weight`` (``[F, hidden]`` each) become
    ``experts.weight1`` and the ``linear_fc2`` weights ``experts.weight2``, laid out as megatron's
    ``GroupedMLP`` (and ``RegistryGroupedMLP``) hold them. Works for parameters and gradients
    alike (the map is a permutation); other entries are kept.

    Raises:
        ValueError: a layer does not have all ``num_experts`` experts.
    """
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = _SEQUENTIAL_FC.match(name)
        if match is None:
            out[name] = tensor
        else:
            groups.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = tensor
    for (prefix, which), experts in groups.items():
        if sorted(experts) != list(range(num_experts)):
            raise ValueError(f"{prefix}: experts {sorted(experts)} are not 0..{num_experts - 1}")
        stacked = torch.stack([experts[e].t() for e in range(num_experts)])  # [E, in, out]
        shape = (stacked.shape[1], -1) if which == "1" else (-1, stacked.shape[2])
        out[f"{prefix}.weight{which}"] = stacked.reshape(shape)
    return out


def split_microbatches(batches: list[dict[str, torch.Tensor]], parts: int) -> list[dict[str, torch.Tensor]]:
    """Every microbatch cut into ``parts`` row blocks (microbatch 0's blocks first).

    These are the microbatches ``parts`` data-parallel ranks run, all on one rank: quantities
    computed per microbatch (MoE auxiliary losses) then equal the data-parallel run's.
    """
    return [shard_batches([batch], rank, parts)[0] for batch in batches for rank in range(parts)]


def reset_aux_losses() -> None:
    """Empty megatron's MoE auxiliary-loss tracker (its entries hold the process groups of a layout)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


@dataclass
class TrainHistory:
    """What :func:`train_steps` saw at every step.

    Attributes:
        losses: the whole batch's LM loss. aux_losses: :func:`read_aux_losses` of the step.
        grad_norms: the norm the optimizer clipped with.
    """

    losses: list[float] = field(default_factory=list)
    aux_losses: list[dict[str, float]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def train_steps(
    chunks: list[Any],
    optimizer: Any,
    steps: list[list[dict[str, torch.Tensor]]],
    after_backward: Callable[[int], None] | None = None,
) -> TrainHistory:
    """Several training steps (megatron's schedule, then ``optimizer.step()``), recording losses.

    Args:
        chunks: this rank's model chunks.
        optimizer: megatron's optimizer of the chunks.
        steps: per step, the microbatches this rank runs.
        after_backward: called with the step index after the backward (gradients reduced,
            router biases updated) and before the optimizer step.

    Raises:
        RuntimeError: the optimizer skipped a step (non-finite gradients).
    """
    history = TrainHistory()
    reset_aux_losses()
    for index, batches in enumerate(steps):
        optimizer.zero_grad()
        history.losses.append(global_loss(run_forward_backward(chunks, batches)))
        history.aux_losses.append(read_aux_losses(len(batches)))
        if after_backward is not None:
            after_backward(index)
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"the optimizer skipped step {index} (non-finite gradients)")
        history.grad_norms.append(float(grad_norm))
    return history


def expert_biases(chunks: list[Any]) -> dict[str, torch.Tensor]:
    """The routers' expert-bias buffers (aux-loss-free balancing), cloned, by single-rank name."""
    biases = {}
    for chunk in chunks:
        gpt = unwrap(chunk)
        for name, buffer in gpt.named_buffers():
            layer = _LAYER.match(name)
            if layer and name.endswith(".router.expert_bias"):
                number = gpt.decoder.layers[int(layer.group(1))].layer_number
                biases[f"decoder.layers.{number - 1}." + name[layer.end() :]] = buffer.detach().clone()
    return biases


__all__ = [
    "Comparison",
    "ParallelSizes",
    "ParamShard",
    "Reference",
    "TinyGPTConfig",
    "broadcast_state",
    "build_gpt",
    "check_layout",
    "compare_with_full",
    "destroy_parallel",
    "full_grads",
    "full_state",
    "global_loss",
    "init_parallel",
    "load_full_state",
    "local_batches",
    "local_grad",
    "make_batches",
    "merge_summaries",
    "param_shards",
    "run_forward_backward",
    "run_reference",
    "shard_batches",
    "train_step",
    "transformer_config",
    "unwrap",
    "TrainHistory",
    "expert_biases",
    "grouped_expert_state",
    "read_aux_losses",
    "reset_aux_losses",
    "split_microbatches",
    "train_steps",
]
