"""The buffer as a threaded Ray actor: the same API, errors and blocking through the client.

One ``ray.init`` for the module (it costs ~7 s and ~1.3 GB on a 2-core machine).
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import pytest
import torch

from mindspeed_rl.buffer import BufferClient, StalenessError, create_buffer_actor


@pytest.fixture(scope="module")
def ray_local():
    if importlib.util.find_spec("ray") is None:  # not importorskip: ray must not be imported before init_ray
        pytest.skip("ray is not installed")
    from mindspeed_rl.driver.ray_runtime import LOCAL_RAY_ENV_DEFAULTS, RAY_ENV_DEFAULTS, init_ray

    saved = {k: os.environ.get(k) for k in {**RAY_ENV_DEFAULTS, **LOCAL_RAY_ENV_DEFAULTS}}
    ray = init_ray(num_cpus=2)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.slow
def test_buffer_actor_round_trip_errors_and_blocking(ray_local) -> None:
    handle = create_buffer_actor(["response_ids", "rewards"], rows_per_step=2, max_staleness=1, name="rl-buffer")
    buffer = BufferClient(ray_local.get_actor("rl-buffer"))
    rows = buffer.allocate(4, 0)
    buffer.put("response_ids", rows, torch.arange(8).view(4, 2))
    buffer.put("rewards", rows, [1.0, 0.0, 0.5, 0.5])
    taken = buffer.wait_ready(["response_ids", "rewards"], 2, consumer="trainer", timeout=10)
    got = buffer.get(["response_ids", "rewards", "version"], taken)
    torch.testing.assert_close(torch.stack(got["response_ids"]), torch.tensor([[0, 1], [2, 3]]))
    assert got["rewards"] == [1.0, 0.0] and got["version"] == [0, 0]
    with pytest.raises(StalenessError):  # the actor's exception comes back as its own class
        buffer.allocate(2, 0, timeout=0.05)
    # A producer blocked inside the actor does not block the actor: discard() from here frees it.
    admitted: list[int] = []
    producer = threading.Thread(target=lambda: admitted.extend(BufferClient(handle).allocate(2, 0, timeout=20)))
    producer.start()
    time.sleep(0.5)
    assert not admitted
    buffer.discard(rows[2:])
    producer.join(timeout=20)
    assert admitted == [4, 5]
    buffer.mark_consumed(taken)
    buffer.advance_version()
    buffer.advance_version()
    with pytest.raises(StalenessError, match="sync the producer's weights"):
        buffer.allocate(1, 0)
    stats = buffer.stats()
    assert stats["version"] == 2 and stats["consumed"] == 2 and stats["expired"] == 2 and stats["discarded"] == 2
    with pytest.raises(AttributeError, match="no method"):
        _ = buffer.not_a_method
