"""The generic engine: plan a whole conversion, checked on both sides, before reading a tensor.

:func:`plan_conversion` expands a bridge's rules for a model, then checks that

- every megatron parameter of the model (:func:`megatron_params`) is produced by exactly one rule,
  and no rule produces anything else;
- (given the Hugging Face checkpoint's names and shapes) every tensor in the checkpoint is used by
  exactly one rule or knowingly dropped, every tensor a rule needs is there, and the shapes the
  rules compute equal the megatron shapes the config implies.

Any failure is one ``ValueError`` that lists the leftover names. The resulting
:class:`ConversionPlan` drives the streaming converters; :func:`hf_to_megatron` and
:func:`megatron_to_hf` run it on in-memory state dicts (tests, weight sync).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mindspeed_llm.bridges.base import Bridge
from mindspeed_llm.bridges.megatron_params import MegatronParam, megatron_params
from mindspeed_llm.bridges.rules import Task, expand_optional, expand_rule
from mindspeed_llm.bridges.shape import ModelShape
from mindspeed_llm.bridges.stacked import stack_state, unstack_shapes, unstack_state

Shape = tuple[int, ...]


def list_names(names: list[str] | set[str], limit: int = 8) -> str:
    """``a, b, c ... and 12 more``: a one-line list for error messages."""
    names = sorted(names)
    head = ", ".join(names[:limit])
    return head + (f" ... and {len(names) - limit} more" if len(names) > limit else "")


@dataclass
class ConversionPlan:
    """A checked mapping between a Hugging Face checkpoint and the unsharded megatron model.

    Attributes:
        bridge: the family's bridge.
        shape: the model.
        tasks: one per megatron parameter, in the megatron model's order (layer by layer).
        params: the megatron parameters by name.
        dropped_hf: Hugging Face tensors present in the source that are deliberately not converted.
        hf_copies: Hugging Face name -> the names of its copies (tensors a Hugging Face checkpoint
            repeats and megatron holds once, see :class:`~mindspeed_llm.bridges.rules.CopyOf`):
            checked against the original when read, written with the original's bytes.
    """

    bridge: Bridge
    shape: ModelShape
    tasks: list[Task]
    params: dict[str, MegatronParam]
    dropped_hf: list[str] = field(default_factory=list)
    hf_copies: dict[str, list[str]] = field(default_factory=dict)

    def hf_names(self) -> list[str]:
        """Every Hugging Face tensor the plan reads or writes, in task order."""
        return [name for task in self.tasks for name in task.hf_names]

    def hf_shapes(self) -> dict[str, Shape]:
        """Hugging Face name -> shape, computed from the megatron shapes (for writing without a source)."""
        out = {}
        for task in self.tasks:
            shapes = task.rule.hf_shapes(self.params[task.mg_name].shape, self.shape)
            out.update(zip(task.hf_names, shapes))
        return out


def plan_conversion(bridge: Bridge, shape: ModelShape, hf_shapes: Mapping[str, Shape] | None = None) -> ConversionPlan:
    """Expand and check the bridge's rules for ``shape``.

    Args:
        bridge: the family's bridge.
        shape: the model.
        hf_shapes: name -> shape of every tensor in the Hugging Face checkpoint (``None`` when
            converting towards Hugging Face: only the megatron side is checked).

    Returns:
        The plan.

    Raises:
        ValueError: leftovers on either side, a tensor produced twice, or a shape mismatch.
    """
    params = megatron_params(shape)
    if hf_shapes is not None and bridge.hf_stacks:  # the rules see stacked experts one at a time
        hf_shapes = unstack_shapes(hf_shapes, bridge.hf_stacks)
    tasks = [task for rule in bridge.param_rules() for task in expand_rule(rule, shape)]
    produced: dict[str, Task] = {}
    for task in tasks:
        if task.mg_name in produced:
            raise ValueError(
                f"the {bridge.family} bridge produces {task.mg_name} twice "
                f"(from {produced[task.mg_name].hf_names} and {task.hf_names})"
            )
        produced[task.mg_name] = task
    extra = set(produced) - set(params)
    if extra:
        raise ValueError(
            f"the {bridge.family} bridge produces parameters the megatron model does not have: {list_names(extra)}"
        )
    missing = set(params) - set(produced)
    if missing:
        raise ValueError(
            f"no rule of the {bridge.family} bridge produces these megatron parameters: {list_names(missing)}"
        )
    order = {name: index for index, name in enumerate(params)}
    tasks.sort(key=lambda task: order[task.mg_name])
    plan = ConversionPlan(bridge, shape, tasks, params)
    produced_hf = {name for task in tasks for name in task.hf_names}
    for rule in bridge.param_rules():
        for copy, original in (rule.copies(shape) if hasattr(rule, "copies") else {}).items():
            if original not in produced_hf:
                raise ValueError(
                    f"the {bridge.family} bridge copies {original} into {copy}, but no rule makes {original}"
                )
            plan.hf_copies.setdefault(original, []).append(copy)
    if hf_shapes is not None:
        _check_hf_side(plan, hf_shapes)
    return plan


def _check_hf_side(plan: ConversionPlan, hf_shapes: Mapping[str, Shape]) -> None:
    family = plan.bridge.family
    used: dict[str, str] = {}
    for task in plan.tasks:
        for name in task.hf_names:
            if name in used:
                raise ValueError(
                    f"{name} is used by two rules of the {family} bridge ({used[name]} and {task.mg_name})"
                )
            used[name] = task.mg_name
    absent = [name for name in used if name not in hf_shapes]
    if absent:
        raise ValueError(
            f"the checkpoint lacks tensors the {family} bridge needs for this config: {list_names(absent)}"
        )
    copies = {copy: original for original, names in plan.hf_copies.items() for copy in names}
    for copy, original in copies.items():
        if copy in hf_shapes and tuple(hf_shapes[copy]) != tuple(hf_shapes[original]):
            raise ValueError(
                f"shape mismatch: {copy} {tuple(hf_shapes[copy])} should repeat {original} {tuple(hf_shapes[original])}"
            )
    rules = plan.bridge.param_rules()
    optional = {name for rule in rules for name in expand_optional(rule, plan.shape)} | set(copies)
    optional |= {
        name
        for name in hf_shapes
        if name not in used and any(rule.drops(name, plan.shape) for rule in rules if hasattr(rule, "drops"))
    }
    plan.dropped_hf = sorted(name for name in hf_shapes if name not in used and name in optional and name not in copies)
    leftover = [name for name in hf_shapes if name not in used and name not in optional]
    if leftover:
        raise ValueError(
            f"no rule of the {family} bridge matches these checkpoint tensors (does config.json describe "
            f"this checkpoint?): {list_names(leftover)}"
        )
    for task in plan.tasks:
        inputs = [tuple(hf_shapes[name]) for name in task.hf_names]
        expected = plan.params[task.mg_name].shape
        try:
            got = task.rule.megatron_shape(inputs, plan.shape)
        except ValueError as err:
            raise ValueError(f"shape mismatch in {', '.join(task.hf_names)}: {err}") from None
        if tuple(got) != expected:
            shapes = ", ".join(f"{n} {s}" for n, s in zip(task.hf_names, inputs))
            raise ValueError(
                f"shape mismatch: {shapes} give {task.mg_name} {tuple(got)} but config.json implies {expected}"
            )


def hf_to_megatron(plan: ConversionPlan, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run ``plan`` on an in-memory Hugging Face state dict.

    Returns:
        The unsharded megatron state dict (parameter names of :func:`megatron_params`).
    """
    hf_state = unstack_state(hf_state, plan.bridge.hf_stacks)
    return {
        task.mg_name: task.rule.to_megatron([hf_state[n] for n in task.hf_names], plan.shape) for task in plan.tasks
    }


def megatron_to_hf(plan: ConversionPlan, mg_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run ``plan`` backwards on an unsharded megatron state dict.

    Returns:
        The Hugging Face state dict (contiguous tensors, as safetensors wants them).
    """
    out: dict[str, torch.Tensor] = {}
    for task in plan.tasks:
        for name, tensor in zip(task.hf_names, task.rule.to_hf(mg_state[task.mg_name], plan.shape)):
            out[name] = tensor.contiguous()
    return stack_state(out, plan.bridge.hf_stacks)
