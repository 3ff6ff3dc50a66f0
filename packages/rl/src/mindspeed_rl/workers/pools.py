"""Resource pools: where the RL workers run, through the accelerator seam.

A pool is a Ray placement group of one bundle per device. The bundle asks for one unit of the
accelerator's Ray resource (``get_accelerator().ray_resource``: ``GPU`` on CUDA hosts, ``NPU``
on Ascend hosts, none on the CPU) and one CPU; Ray then pins each worker of the pool to its own
device and sets the visible-devices variable, so inside a worker the device is always index 0.

On the CPU "devices" are worker processes: a local Ray instance is started with at least as
many CPU slots as the layout has workers (a 2-core laptop can still run a 2 x 2 layout; the
processes share the cores), so a recipe that runs on a GPU node also runs on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger

logger = get_logger(__name__)


def device_resource() -> str:
    """Ray resource name of one device of this host's accelerator (``""`` on the CPU)."""
    return get_accelerator().ray_resource


def bundle(cpus: float = 1.0, extra: dict[str, float] | None = None) -> dict[str, float]:
    """The resources of one worker: one device (when there is an accelerator), ``cpus`` CPUs and
    the ``extra`` custom resources that pin it to some nodes (``ray.pool_resources``)."""
    resource = device_resource()
    return {"CPU": cpus, **({resource: 1.0} if resource else {}), **(extra or {})}


@dataclass
class ResourcePool:
    """A placement group of ``size`` device bundles, packed on as few nodes as possible.

    Attributes:
        name: what the pool hosts (``actor``, ``rollout``, ``critic``), for messages.
        size: devices (= workers) in the pool.
        resources: custom Ray resources each bundle asks for (``ray.pool_resources``: the pool
            goes to the nodes that offer them).
        group: the Ray placement group (after :meth:`create`).
    """

    name: str
    size: int
    resources: dict[str, float] = field(default_factory=dict)
    group: Any = None

    def create(self, timeout: float = 120.0) -> ResourcePool:
        """Reserve the pool's resources (waits up to ``timeout`` seconds).

        Raises:
            RuntimeError: the cluster cannot offer the bundles in time (names the pool and its needs).
        """
        import ray
        from ray.util.placement_group import placement_group

        self.group = placement_group(
            [bundle(extra=self.resources) for _ in range(self.size)], strategy="PACK", name=f"mindspeed-{self.name}"
        )
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            raise RuntimeError(
                f"the {self.name} pool needs {self.size} x {bundle(extra=self.resources)} but the Ray cluster offers "
                f"{ray.available_resources()}; shrink the layout or add nodes"
            )
        logger.info("the %s pool: %d workers on node(s) %s", self.name, self.size, " ".join(self.nodes()))
        return self

    def nodes(self) -> list[str]:
        """The Ray node ids of the pool's bundles, in bundle order (after :meth:`create`)."""
        from ray.util import placement_group_table

        placed = placement_group_table(self.group).get("bundles_to_node_id", {})
        return [str(placed.get(i, "?")) for i in range(self.size)]

    def options(self, index: int) -> dict[str, Any]:
        """``ActorClass.options`` that place a worker on bundle ``index`` of the pool."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resource = device_resource()
        placement = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=index)
        options: dict[str, Any] = {"num_cpus": 1, "scheduling_strategy": placement}
        if resource == "GPU":
            options["num_gpus"] = 1
        elif resource:
            options["resources"] = {resource: 1}
        return options

    def remove(self) -> None:
        """Give the resources back."""
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def local_cpus(workers: int) -> int:
    """CPU slots for a local Ray instance: all cores, and at least one per worker."""
    import os

    return max(os.cpu_count() or 1, workers)
