"""Hugging Face-named tensors into the decoder's megatron-named weights, through the family's bridge.

This is the weight-sync path of RL (the actor exports Hugging Face tensors through its bridge,
the rollout engine takes them here): the same rules that convert checkpoints fuse q/k/v and
gate/up into the decoder's layout, whatever layout the actor trains in. Tensors may arrive in
any grouping over several calls (buckets): a fused parameter is written once all of its parts
have arrived.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mindspeed_llm.bridges import Bridge, ModelShape, plan_conversion
from mindspeed_llm.bridges.engine import list_names
from mindspeed_llm.bridges.rules import Task, expand_optional


def copy_checked(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """``target.copy_(value)`` after checking the shape (dtype and device are converted).

    Raises:
        ValueError: the shapes differ.
    """
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{name} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}")
    target.copy_(value)


class WeightLoader:
    """Writes Hugging Face-named tensors into megatron-named target tensors.

    Args:
        bridge: the family's bridge.
        shape: the model.
        targets: megatron name -> tensor to copy into (the decoder's weights).
    """

    def __init__(self, bridge: Bridge, shape: ModelShape, targets: Mapping[str, torch.Tensor]) -> None:
        self.plan = plan_conversion(bridge, shape)
        self.targets = targets
        self.task_of: dict[str, Task] = {name: task for task in self.plan.tasks for name in task.hf_names}
        rules = bridge.param_rules()
        # Names a checkpoint may carry that hold nothing the model uses (a tied lm_head, rotary buffers).
        self.ignored = {name for rule in rules for name in expand_optional(rule, shape)}
        self._drop_rules = [rule for rule in rules if hasattr(rule, "drops")]
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def _is_ignored(self, name: str) -> bool:
        return name in self.ignored or any(rule.drops(name, self.plan.shape) for rule in self._drop_rules)

    def load(self, hf_state: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy ``hf_state`` into the targets.

        Args:
            hf_state: Hugging Face name -> tensor (any dtype and device; a subset of the model is fine).

        Returns:
            The megatron names written by this call.

        Raises:
            ValueError: a name the model does not have (nothing is written then), or a shape mismatch.
        """
        unknown = [name for name in hf_state if name not in self.task_of and not self._is_ignored(name)]
        if unknown:
            raise ValueError(
                f"the {self.plan.bridge.family} model has no tensors named {list_names(unknown)} "
                "(Hugging Face checkpoint names are expected, e.g. model.layers.0.self_attn.q_proj.weight)"
            )
        touched: dict[str, Task] = {}
        for name, tensor in hf_state.items():
            task = self.task_of.get(name)
            if task is not None:
                self.pending.setdefault(task.mg_name, {})[name] = tensor
                touched[task.mg_name] = task
        written = []
        for mg_name, task in touched.items():
            parts = self.pending[mg_name]
            if len(parts) < len(task.hf_names):
                continue  # the other parts of this fused parameter come later
            tensors = [parts[name] for name in task.hf_names]
            try:
                fused = task.rule.to_megatron(tensors, self.plan.shape)
            except RuntimeError as err:  # a reshape that cannot work: wrong sizes
                shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(task.hf_names, tensors))
                raise ValueError(f"cannot build {mg_name} from {shapes}: {err}") from None
            copy_checked(self.targets[mg_name], fused, f"{mg_name} (from {', '.join(task.hf_names)})")
            del self.pending[mg_name]
            written.append(mg_name)
        return written

    def plan_task(self, mg_name: str) -> Task:
        """The plan's task producing ``mg_name``."""
        return next(task for task in self.plan.tasks if task.mg_name == mg_name)
