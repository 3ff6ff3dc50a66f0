"""Benchmark the GRPO actor's fast path: log-prob pass + update CPU seconds with and without the device redirect.

One spawned rank builds the tiny Llama actor and runs ``compute_logprobs`` + ``update`` on six
(prompt, response) pairs, alternating the calls' scope between ``mindspeed.megatron.fast_path``
(as the actor runs) and the device redirect ``adapt()`` enters (the actor before), so a load
change on the shared machine shifts both alike. Prints the load average before and after, the
torch-function hops per pass and the mean process CPU seconds of each, with the ratio. Usage::

    uv run --frozen python tools/bench/actor_fast_path.py [--reps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from typing import Any

from mindspeed.testing.distributed import run_distributed

PAIRS = [
    ([1, 5, 9, 14] * 4, [20, 21, 7] * 8),
    ([3, 4] * 8, [30, 31, 32, 33, 2] * 6),
    ([8, 9, 10, 11, 12] * 3, [40] * 20),
] * 2


def _rank(rank: int, world_size: int, root: str, reps: int) -> dict[str, Any]:
    import torch

    from mindspeed.device.cuda_shim import DeviceRedirectMode
    from mindspeed_rl.models import actor as actor_module

    calls = [0]
    original = DeviceRedirectMode.__torch_function__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    DeviceRedirectMode.__torch_function__ = counted
    settings = actor_module.ActorSettings.adamw(lr=1e-4, micro_batch_size=2, clip_grad=1.0, loss="dapo")
    actor = actor_module.Actor(f"{root}/hf", settings)
    advantages = torch.tensor([1.0, -1.0, 0.5] * 2)
    width = max(len(r) for _, r in PAIRS)
    fast_path = actor_module.fast_path
    out: dict[str, Any] = {"cpu": {"redirect": [], "fast": []}, "hops": {}}
    try:
        for rep in range(reps + 1):  # the first round warms up
            for name, scope in (("redirect", contextlib.nullcontext), ("fast", fast_path)):
                actor_module.fast_path = scope
                hops, cpu = calls[0], time.process_time()
                rows = actor.compute_logprobs(PAIRS)
                hops -= calls[0]  # the padding below is the bench's, not the actor's
                old = torch.zeros(len(PAIRS), width)
                for i, row in enumerate(rows):
                    old[i, : len(row)] = row
                hops += calls[0]
                actor.update(PAIRS, old, advantages)
                if rep:
                    out["cpu"][name].append(time.process_time() - cpu)
                out["hops"][name] = calls[0] - hops
    finally:
        actor_module.fast_path = fast_path
        DeviceRedirectMode.__torch_function__ = original
        actor.close()
    return out


def main() -> int:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        save_tiny_checkpoint("llama2", f"{root}/hf", seed=0)
        print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        (result,) = run_distributed(_rank, 1, root, args.reps, timeout=600)
        print("load average after:  {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    cpu = {name: sum(v) / len(v) for name, v in result["cpu"].items()}
    print(
        f"torch-function hops per logprobs+update: redirect {result['hops']['redirect']}, fast {result['hops']['fast']}"
    )
    print(f"CPU s per logprobs+update: redirect {cpu['redirect']:.4f}, fast {cpu['fast']:.4f}")
    print(f"ratio redirect / fast: {cpu['redirect'] / cpu['fast']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
