"""The replay buffer without Ray: columns by index, consumers, and staleness enforced both ways."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from mindspeed_rl.buffer import ReplayBuffer, StalenessError

COLUMNS = ("prompt_ids", "response_ids", "rewards", "old_logp")


def _fill(buffer: ReplayBuffer, rows: list[int], columns=COLUMNS) -> None:
    for column in columns:
        buffer.put(column, rows, [f"{column}-{i}" for i in rows])


def test_columns_by_index_and_consumers() -> None:
    buffer = ReplayBuffer(COLUMNS, rows_per_step=4)
    rows = buffer.allocate(4, version=0)
    assert rows == [0, 1, 2, 3]
    buffer.put("prompt_ids", rows, torch.arange(8).view(4, 2))  # a tensor is split along dim 0
    buffer.put("response_ids", rows[2:], [[5], [6, 7]])
    assert buffer.ready_count(["prompt_ids", "response_ids"]) == 2
    with pytest.raises(TimeoutError, match="2 of 3 rows"):
        buffer.wait_ready(["prompt_ids", "response_ids"], 3, timeout=0.05)
    buffer.put("response_ids", rows[:2], [[1], [2, 3, 4]])
    # the reference worker and the trainer each get every row once; oldest first
    assert buffer.wait_ready(["prompt_ids"], 2, consumer="reference") == [0, 1]
    assert buffer.wait_ready(["prompt_ids"], 2, consumer="reference") == [2, 3]
    assert buffer.ready_count(["prompt_ids"], consumer="reference") == 0
    assert buffer.wait_ready(["prompt_ids", "response_ids"], 4, consumer="trainer") == rows
    got = buffer.get(["response_ids", "prompt_ids", "version"], [3, 0])
    assert got["response_ids"] == [[6, 7], [1]] and got["version"] == [0, 0]
    torch.testing.assert_close(got["prompt_ids"][0], torch.tensor([6, 7]))
    buffer.mark_consumed(rows)
    stats = buffer.stats()
    assert stats["live_rows"] == 0 and stats["consumed"] == 4 and stats["staleness_histogram"] == {0: 4}


def test_bad_calls_name_the_problem() -> None:
    buffer = ReplayBuffer(COLUMNS, rows_per_step=2)
    rows = buffer.allocate(2, version=0)
    with pytest.raises(ValueError, match="unknown column 'logits'"):
        buffer.put("logits", rows, [1, 2])
    with pytest.raises(ValueError, match="3 values for 2 rows"):
        buffer.put("rewards", rows, [1, 2, 3])
    buffer.put("rewards", rows, [1.0, 0.0])
    with pytest.raises(ValueError, match="already have it"):
        buffer.put("rewards", rows, [1.0, 0.0])
    buffer.put("rewards", rows, [0.5, 0.5], overwrite=True)
    with pytest.raises(ValueError, match="not written yet"):
        buffer.get(["old_logp"], rows)
    with pytest.raises(ValueError, match="row 7 is not in the buffer"):
        buffer.get(["rewards"], [7])
    with pytest.raises(ValueError, match="never allocated"):
        buffer.mark_consumed([9])
    with pytest.raises(ValueError, match="ahead of the trainer"):
        buffer.allocate(1, version=1)
    with pytest.raises(ValueError, match="between 1 and"):
        buffer.allocate(3, version=0)
    with pytest.raises(ValueError, match="sync needs 0"):
        ReplayBuffer(COLUMNS, 2, max_staleness=1, mode="sync")
    with pytest.raises(ValueError, match="built in"):
        ReplayBuffer(("version",), 2)


def test_sync_mode_is_on_policy() -> None:
    buffer = ReplayBuffer(COLUMNS, rows_per_step=2, mode="sync")
    first = buffer.allocate(2, version=0)
    # one batch ahead is the limit: a second batch of version 0 is refused
    with pytest.raises(StalenessError, match="ahead of the trainer"):
        buffer.allocate(2, version=0, timeout=0.05)
    assert not buffer.can_allocate(1, 0)
    _fill(buffer, first)
    taken = buffer.wait_ready(COLUMNS, 2)
    buffer.mark_consumed(taken)
    assert not buffer.can_allocate(1, 0)  # consumed at version 0: the next rows belong to version 1
    buffer.advance_version()
    with pytest.raises(StalenessError, match="sync the producer's weights"):
        buffer.allocate(2, version=0)
    second = buffer.allocate(2, version=1)
    _fill(buffer, second[:1])
    assert buffer.advance_version() == second  # the unconsumed rows of version 1 expire at version 2
    assert buffer.ready_count(COLUMNS) == 0 and buffer.stats()["expired"] == 2


def test_async_bounded_staleness_blocks_and_refuses() -> None:
    R, s = 2, 1
    buffer = ReplayBuffer(COLUMNS, rows_per_step=R, max_staleness=s)
    assert buffer.mode == "async"
    ahead = buffer.allocate(2 * R, version=0)  # consumed at versions 0 and 1: allowed
    _fill(buffer, ahead)
    outcome: dict[str, object] = {}

    def producer() -> None:
        try:
            outcome["rows"] = buffer.allocate(R, version=0)  # would be consumed at version 2: blocks
        except StalenessError as err:
            outcome["error"] = err

    thread = threading.Thread(target=producer)
    thread.start()
    time.sleep(0.1)
    assert thread.is_alive()  # blocked, not admitted
    buffer.mark_consumed(buffer.wait_ready(COLUMNS, R))
    buffer.advance_version()  # version 1: the rows of version 0 still waiting have staleness 1
    time.sleep(0.1)
    assert thread.is_alive()
    assert buffer.get(["version"], buffer.wait_ready(COLUMNS, R))["version"] == [0, 0]
    buffer.mark_consumed([2, 3])
    buffer.advance_version()  # version 2: version-0 weights are now too old for any new row
    thread.join(timeout=5)
    assert "rows" not in outcome  # never admitted: refused once its weights fell too far behind
    assert "sync the producer's weights" in str(outcome["error"])
    assert buffer.stats()["staleness_histogram"] == {0: 2, 1: 2}


def test_blocked_producer_admitted_when_rows_are_discarded() -> None:
    buffer = ReplayBuffer(COLUMNS, rows_per_step=4)
    rows = buffer.allocate(4, version=0)
    admitted = []
    thread = threading.Thread(target=lambda: admitted.extend(buffer.allocate(2, version=0, timeout=5)))
    thread.start()
    time.sleep(0.1)
    assert not admitted
    buffer.discard(rows[:2])  # dynamic sampling dropped a group: room for a refill
    thread.join(timeout=5)
    assert admitted == [4, 5] and buffer.stats()["discarded"] == 2


def test_consumer_wakes_when_the_last_column_lands_and_close_wakes_all() -> None:
    buffer = ReplayBuffer(COLUMNS, rows_per_step=2)
    rows = buffer.allocate(2, version=0)
    _fill(buffer, rows, COLUMNS[:-1])
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.extend(buffer.wait_ready(COLUMNS, 2, timeout=5)))
    thread.start()
    time.sleep(0.05)
    assert not got
    buffer.put("old_logp", rows, [0.0, 0.0])
    thread.join(timeout=5)
    assert got == rows
    errors: list[Exception] = []

    def wait() -> None:
        try:
            buffer.wait_ready(COLUMNS, 5)
        except RuntimeError as err:
            errors.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    buffer.close()
    waiter.join(timeout=5)
    assert "closed" in str(errors[0])
    buffer.clear()
    assert buffer.stats()["live_rows"] == 0


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_threaded_pipeline_never_trains_on_stale_rows(max_staleness: int) -> None:
    R, steps = 4, 12
    buffer = ReplayBuffer(COLUMNS, rows_per_step=R, max_staleness=max_staleness)
    rng = random.Random(max_staleness)
    seen: list[int] = []

    def rollout() -> None:
        while True:
            version = buffer.get_version()  # "sync weights": take the trainer's newest version
            try:
                rows = buffer.allocate(2, version, timeout=2)
            except StalenessError:
                continue
            except RuntimeError:
                return  # closed
            time.sleep(rng.random() * 0.002)
            try:
                _fill(buffer, rows)
            except ValueError:
                continue  # the rows expired under us (not expected: admission keeps them fresh)
            except RuntimeError:
                return  # closed

    producers = [threading.Thread(target=rollout) for _ in range(2)]
    for p in producers:
        p.start()
    for step in range(steps):
        rows = buffer.wait_ready(COLUMNS, R, timeout=10)
        versions = buffer.get(["version"], rows)["version"]
        seen.extend(step - v for v in versions)
        assert all(0 <= step - v <= max_staleness for v in versions)
        buffer.mark_consumed(rows)
        buffer.advance_version()
    buffer.close()
    for p in producers:
        p.join(timeout=5)
    stats = buffer.stats()
    assert stats["consumed"] == R * steps and stats["staleness_max"] <= max_staleness
    assert sum(stats["staleness_histogram"].values()) == R * steps
    if max_staleness:
        assert max(seen) >= 1  # the rollout did run ahead
