"""Tokens per expert per MoE layer, counted by forward hooks on megatron's routers, logged on rank 0.

Every megatron-core router returns ``(probs, routing_map)``, ``routing_map [tokens, experts]``
saying which experts each of this rank's tokens goes to, before any dispatch. A forward hook
(nothing is patched) adds ``routing_map.sum(0)`` to a per-layer counter on the device, with
no host synchronisation. :meth:`ExpertLoadTracker.collect` sums the counters over the ranks
once per logging step: ranks of one tensor-parallel group see the same tokens unless
sequence parallelism splits them, so the sum is divided by that replication, and pipeline
stages fill their own layers. The result is the whole batch's tokens per expert, and the
load imbalance of a layer is ``max / mean`` of its counts (1.0 is perfectly even)::

    tracker = ExpertLoadTracker().attach(model_chunks)
    for step in range(steps):
        train_step(...)
        tracker.log_step(step)        # on every rank: it is a collective
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.log import get_logger, get_rank

logger = get_logger(__name__)


@dataclass
class ExpertLoad:
    """Tokens routed to each expert of every MoE layer over some steps, summed over all ranks.

    Attributes:
        step: the step it was collected at.
        counts: layer number (megatron's, 1-based) -> tokens per expert.
    """

    step: int
    counts: dict[int, list[int]] = field(default_factory=dict)

    def imbalance(self, layer: int) -> float:
        """``max / mean`` of the layer's counts (1.0: even; ``num_experts``: all on one expert)."""
        counts = self.counts[layer]
        total = sum(counts)
        return max(counts) * len(counts) / total if total else 1.0

    @property
    def max_imbalance(self) -> float:
        """The worst layer's imbalance (1.0 when nothing was counted)."""
        return max((self.imbalance(layer) for layer in self.counts), default=1.0)

    def to_dict(self) -> dict[str, float]:
        """Flat scalars for a metrics writer (``moe/expert_load_imbalance``, per layer and expert)."""
        out = {"moe/expert_load_imbalance": self.max_imbalance}
        for layer, counts in self.counts.items():
            out[f"moe/layer_{layer}/load_imbalance"] = self.imbalance(layer)
            out.update({f"moe/layer_{layer}/expert_{e}_tokens": float(n) for e, n in enumerate(counts)})
        return out

    def describe(self, per_layer: bool = True) -> str:
        """Log text: the summary line, then one line per layer."""
        if not self.counts:
            return f"expert load at step {self.step}: no MoE layer ran"
        worst = max(self.counts, key=self.imbalance)
        lines = [
            f"expert load at step {self.step}: max/mean {self.max_imbalance:.3f} (layer {worst}), "
            f"{len(self.counts)} MoE layers"
        ]
        if per_layer:
            lines += [
                f"  layer {layer}: tokens per expert {counts} max/mean {self.imbalance(layer):.3f}"
                for layer, counts in sorted(self.counts.items())
            ]
        return "\n".join(lines)


class ExpertLoadTracker:
    """Counts the tokens each expert of each MoE layer receives, through forward hooks on the routers.

    Args:
        interval: :meth:`log_step` collects and logs every ``interval`` steps.
        per_layer: log one line per layer besides the summary.
        group: the process group to sum over (default: the world).
    """

    def __init__(self, interval: int = 1, per_layer: bool = True, group: Any = None) -> None:
        if interval < 1:
            raise ValueError(f"interval={interval} must be >= 1")
        self.interval = interval
        self.per_layer = per_layer
        self.group = group
        self.history: list[ExpertLoad] = []
        self.num_layers = 0
        self.num_experts = 0
        self._counts: dict[int, torch.Tensor] = {}
        self._replication: dict[int, int] = {}
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module | Iterable[torch.nn.Module]) -> ExpertLoadTracker:
        """Hook every megatron router in ``model`` (a module or a list of model chunks).

        Returns:
            ``self``, to chain.
        """
        from megatron.core.transformer.moe.router import Router

        modules = [model] if isinstance(model, torch.nn.Module) else list(model)
        for module in modules:
            for sub in module.modules():
                config = getattr(sub, "config", None)
                if getattr(config, "num_moe_experts", None):
                    # Every rank needs the full shape for the collective, pipeline stages
                    # without a MoE layer included.
                    self.num_layers = max(self.num_layers, config.num_layers + (config.mtp_num_layers or 0))
                    self.num_experts = config.num_moe_experts
                if isinstance(sub, Router) and sub not in self._hooked():
                    self._handles.append((sub, sub.register_forward_hook(self._count)))
        return self

    def _hooked(self) -> list[torch.nn.Module]:
        return [router for router, _ in self._handles]

    def detach(self) -> None:
        """Remove the hooks."""
        for _, handle in self._handles:
            handle.remove()
        self._handles = []

    def _count(self, router: torch.nn.Module, inputs: Any, output: Any) -> None:
        if _in_backward():
            return  # a recomputed forward: its tokens were counted in the forward pass
        _, routing_map = output
        layer = router.layer_number or 0
        counts = routing_map.sum(dim=0).to(torch.int64)
        if layer in self._counts:
            self._counts[layer] += counts
        else:
            self._counts[layer] = counts
        # Tensor-parallel ranks route the same tokens unless sequence parallelism splits them.
        tp = router.tp_group.size() if getattr(router, "tp_group", None) is not None else 1
        self._replication[layer] = 1 if router.config.sequence_parallel else tp

    def reset(self) -> None:
        """Forget the counts since the last collection."""
        self._counts.clear()

    def local_counts(self) -> dict[int, list[int]]:
        """This rank's counts (not summed over ranks), by layer number."""
        return {layer: counts.tolist() for layer, counts in sorted(self._counts.items())}

    def collect(self, step: int = 0) -> ExpertLoad:
        """Sum the counts over the ranks (a collective when distributed) and reset them.

        Returns:
            The whole batch's tokens per expert per layer since the last collection.
        """
        device = next(iter(self._counts.values())).device if self._counts else torch.device("cpu")
        num_layers = max(self.num_layers, max(self._counts, default=0))
        dense = torch.zeros(num_layers + 1, max(self.num_experts, 1), dtype=torch.int64, device=device)
        present = torch.zeros(num_layers + 1, dtype=torch.int64, device=device)
        replication = torch.ones(num_layers + 1, dtype=torch.int64, device=device)
        for layer, counts in self._counts.items():
            dense[layer, : counts.numel()] = counts
            present[layer] = 1
            replication[layer] = self._replication[layer]
        if dist.is_available() and dist.is_initialized():
            for tensor in (dense, present):
                dist.all_reduce(tensor, group=self.group)
            dist.all_reduce(replication, op=dist.ReduceOp.MAX, group=self.group)
        self.reset()
        rows = dense.cpu() // replication.cpu().unsqueeze(1)
        return ExpertLoad(step, {layer: rows[layer].tolist() for layer in range(num_layers + 1) if present[layer]})

    def log_step(self, step: int) -> ExpertLoad | None:
        """Every ``interval`` steps: collect (on every rank) and log on rank 0.

        Returns:
            The collected load, or ``None`` on a step that is not logged.
        """
        if (step + 1) % self.interval:
            return None
        load = self.collect(step)
        self.history.append(load)
        if get_rank() == 0:
            logger.info(load.describe(self.per_layer))
        return load


def _in_backward() -> bool:
    # torch reports the running graph task inside a backward pass, where megatron's activation
    # recomputation re-runs forwards; outside a backward it is -1.
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def moe_layer_count(config: Any) -> int:
    """The MoE layers of a megatron ``TransformerConfig`` (``moe_layer_freq`` as megatron reads it, MTP included).

    Returns:
        0 for a dense model.
    """
    if not getattr(config, "num_moe_experts", None):
        return 0
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        count = sum(1 for i in range(config.num_layers) if i % freq == 0)
    else:
        count = sum(freq)
    return count + (getattr(config, "mtp_num_layers", None) or 0)


def read_aux_losses(
    num_microbatches: int,
    num_layers: int = 1,
    names: Iterable[str] | None = None,
    total_layers: int | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """megatron's MoE auxiliary losses tracked since the last read (``load_balancing_loss``, ``z_loss`` ...), then cleared.

    Each is summed over layers, reduced over pipeline stages and megatron's reduce group (the
    tensor-parallel shards of a sequence), averaged over data-parallel ranks and divided by the
    microbatches this rank ran and by ``num_layers``: with ``num_layers`` the model's MoE layers
    (:func:`moe_layer_count`) this is the value megatron's ``track_moe_metrics`` logs (the mean per
    layer and microbatch, without the coefficient); with 1, the sum over layers. Collective: every
    rank calls it. Clearing also keeps the tracker from adding up over a whole run.

    Args:
        names: the losses to read (:func:`aux_loss_names`); a rank that tracked none of one (a
            pipeline stage of dense layers) adds zeros of ``total_layers`` on ``device`` so that
            every rank runs the same collectives. None: what this rank's tracker holds.

    Returns:
        name -> value; empty when no router tracked a loss (dense models, balancing ``none``).
    """
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    names = sorted(tracker) if names is None else list(names)
    for name in names:  # a stage whose layers are all dense still takes part in the collectives
        if name not in tracker:
            tracker[name] = {"values": torch.zeros(total_layers or 1, device=device)}
    if not names:
        return {}
    reduce_aux_losses_tracker_across_ranks(names)
    scale = num_microbatches * num_layers
    values = {name: tracker[name]["values"].sum().item() / scale for name in names}
    clear_aux_losses_tracker()
    return values


def aux_loss_names(config: Any) -> list[str]:
    """The names megatron's routers track for a ``TransformerConfig``: its balancing losses with a
    non-zero coefficient (``aux_loss`` -> ``load_balancing_loss``, ``seq_aux_loss`` ->
    ``seq_load_balancing_loss``, ``global_aux_loss`` -> ``global_load_balancing_loss``) and ``z_loss``."""
    if not getattr(config, "num_moe_experts", None):
        return []
    types = config.moe_router_load_balancing_type
    types = [types] if isinstance(types, str) else list(types)
    coeffs = config.moe_aux_loss_coeff
    coeffs = [coeffs] * len(types) if isinstance(coeffs, (int, float)) else list(coeffs)
    names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
    names["global_aux_loss"] = "global_load_balancing_loss"
    out = [names[kind] for kind, coeff in zip(types, coeffs) if kind in names and coeff > 0]
    if getattr(config, "moe_z_loss_coeff", None):
        out.append("z_loss")
    return out


def moe_aux_losses(config: Any, num_microbatches: int, device: torch.device | str) -> dict[str, float]:
    """The step's MoE auxiliary losses as megatron's training loop logs them (mean per MoE layer and
    microbatch, without the coefficient), then cleared; ``{}`` for a model with none. Collective."""
    names = aux_loss_names(config)
    if not names:
        return {}
    total = config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
    return read_aux_losses(num_microbatches, moe_layer_count(config), names, total, device)
