"""Ray workers of a GRPO run: resource pools, the actor group, rollout engines (see :mod:`mindspeed_rl.driver.runner`)."""

from mindspeed_rl.workers.pools import ResourcePool, bundle, device_resource

__all__ = ["ResourcePool", "bundle", "device_resource"]
