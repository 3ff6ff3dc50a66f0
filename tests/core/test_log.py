"""Rank-aware logging: every line names its rank; ranks other than 0 keep only warnings and errors."""

from __future__ import annotations

import io
import logging

import pytest

from mindspeed.log import _HANDLER_NAME, PACKAGE_LOGGERS, get_logger, get_rank, setup_logging
from mindspeed.testing.distributed import run_distributed


@pytest.fixture
def restore_logging():
    yield
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
            logger.removeHandler(handler)
        logger.propagate, logger.level = True, logging.NOTSET


def _emit(stream: io.StringIO) -> list[str]:
    for name in ("mindspeed.x", "mindspeed_llm.y", "mindspeed_rl.z"):
        get_logger(name).info("info from %s", name)
    get_logger("mindspeed_mm.w").warning("a warning")
    get_logger("mindspeed.x").debug("a debug line")
    return stream.getvalue().splitlines()


@pytest.mark.parametrize(
    ("rank", "all_ranks", "kept"),
    [
        ("0", False, ["info from mindspeed.x", "info from mindspeed_llm.y", "info from mindspeed_rl.z", "a warning"]),
        ("1", False, ["a warning"]),
        ("1", True, ["info from mindspeed.x", "info from mindspeed_llm.y", "info from mindspeed_rl.z", "a warning"]),
    ],
)
def test_ranks_other_than_0_keep_warnings_only(
    rank: str, all_ranks: bool, kept: list[str], restore_logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", rank)
    stream = io.StringIO()
    setup_logging("INFO", all_ranks=all_ranks, stream=stream)
    setup_logging("INFO", all_ranks=all_ranks, stream=stream)  # reconfiguring does not double the lines
    lines = _emit(stream)
    assert [line.split(": ", 1)[1] for line in lines] == kept
    assert all(f"[rank{rank}]" in line for line in lines)
    assert not logging.getLogger("mindspeed").propagate


def _ranks(rank: int, world_size: int) -> dict:
    import os

    os.environ["RANK"] = "7"  # torch.distributed's rank wins over the variable once initialised
    stream = io.StringIO()
    setup_logging("INFO", stream=stream)
    get_logger("mindspeed.t").info("hello")
    get_logger("mindspeed.t").error("oops")
    return {"rank": get_rank(), "lines": stream.getvalue().splitlines()}


def test_the_rank_comes_from_the_process_group() -> None:
    out = run_distributed(_ranks, 2)
    assert [o["rank"] for o in out] == [0, 1]
    assert [line.split("] ", 1)[1] for line in out[0]["lines"]] == [
        "INFO mindspeed.t: hello",
        "ERROR mindspeed.t: oops",
    ]
    assert [line.split("] ", 1)[1] for line in out[1]["lines"]] == ["ERROR mindspeed.t: oops"]
    assert "[rank0]" in out[0]["lines"][0] and "[rank1]" in out[1]["lines"][0]
