"""Shared pytest setup: accelerator markers skip where the hardware is absent."""

from __future__ import annotations

import os

import pytest

# Before any test module imports ray: under `uv run` (the README's test command) Ray would otherwise
# start every worker of an in-process instance through `uv run` (mindspeed_rl.driver.ray_runtime).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

from mindspeed.device import available_accelerators  # noqa: E402
from mindspeed.testing.distributed import start_fork_server  # noqa: E402
from tests.golden import UPDATE_ENV  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="record the golden losses of the tests run (tests/golden/) instead of comparing them",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--update-golden"):
        os.environ[UPDATE_ENV] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.option.collectonly and any(
        "run_distributed" in getattr(getattr(item, "module", None), "__dict__", {}) for item in items
    ):
        # The gloo groups' ranks fork from one server that imported torch and megatron-core once; started
        # here, before any test sets a run's marker in this process's environment.
        start_fork_server()
    present = set(available_accelerators())
    for item in items:
        for marker, device in (("gpu", "cuda"), ("npu", "npu")):
            if item.get_closest_marker(marker) is not None and device not in present:
                item.add_marker(pytest.mark.skip(reason=f"needs a {device} device"))


@pytest.fixture(autouse=True)
def _quiet_console_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with a console that is not verbose, and leaves none behind.

    ``--verbose`` sets ``MINDSPEED_VERBOSE=1`` in the process so that the ranks it spawns see it;
    a test that parses it in-process would otherwise make every later test (and the commands they
    run as subprocesses) print the detail, and the one-line-error checks fail by order.
    """
    monkeypatch.delenv("MINDSPEED_VERBOSE", raising=False)


@pytest.fixture(scope="session")
def t2i_sft_run(tmp_path_factory: pytest.TempPathFactory):
    """The text-to-image demo's SFT run (``examples/mm/t2i_tiny_cpu.yaml`` as shipped, 300 steps, ~40 s) into a
    session directory: its DCP checkpoint and ``metrics.jsonl`` there, the diffusers export in ``hf/``. Trained once
    for the MM demo test (which checks it) and the Flow-GRPO demo test (which starts from it)."""
    from pathlib import Path

    from mindspeed_mm.cli import main

    root = tmp_path_factory.mktemp("t2i_sft")
    recipe = Path(__file__).resolve().parents[1] / "examples" / "mm" / "t2i_tiny_cpu.yaml"
    overrides = [f"checkpoint.save={root}", f"logging.dir={root}", f"checkpoint.save_hf={root / 'hf'}"]
    assert main(["train", "--config", str(recipe), *overrides, "logging.progress=false"]) == 0
    return root
