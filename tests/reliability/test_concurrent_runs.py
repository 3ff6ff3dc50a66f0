"""Two ``mindspeed-llm pretrain`` processes started together on one ``checkpoint.save``: exactly one trains.

Without the run lock both trained: one died at its first save (``FileNotFoundError`` of the other's
``iter_0000002.tmp``), or the later one resumed from the first one's checkpoint while it still
trained and both wrote the same steps. With it, the second process exits 2 as soon as it reaches
the lock, before the first has finished, with one line naming the holder (its pid and host) and the
fix; the first trains every step and leaves a complete run and no lock file.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from mindspeed.checkpointing import LOCK_FILE, list_complete
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]


def test_two_runs_on_one_save_directory_one_trains_the_other_exits_2(tmp_path: Path, dataset: str) -> None:
    out = tmp_path / "run"
    args = harness.command(*harness.recipe(dataset, out, steps=4))
    procs = [harness.start(args), harness.start(args)]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 300
    while len(ended) < 2 and time.monotonic() < deadline:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.05)
    done = [harness.finish(proc) for proc in procs]
    assert sorted(d.returncode for d in done) == [0, 2], [d.stderr[-2000:] for d in done]
    winner, loser = (0, 1) if done[0].returncode == 0 else (1, 0)
    assert ended[loser] < ended[winner], "the second run did not stop before the first one finished"
    err = done[loser].stderr
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith(f"mindspeed-llm: error: checkpoint.save='{out}' is in use by another run: ")
    assert f"pid {procs[winner].pid} on {socket.gethostname()} since " in line
    assert "set checkpoint.save to another directory" in line
    assert "resumed from" not in err and "saved checkpoint" not in err
    assert [r["step"] for r in harness.numerics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [p.name for p in list_complete(out)] == ["iter_0000002", "iter_0000004"]
    assert not (out / LOCK_FILE).exists() and not list(out.glob("*.tmp"))
