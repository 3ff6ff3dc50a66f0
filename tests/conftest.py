"""Shared pytest setup: accelerator markers skip where the hardware is absent."""

from __future__ import annotations

import pytest

from mindspeed.device import available_accelerators


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    present = set(available_accelerators())
    for item in items:
        for marker, device in (("gpu", "cuda"), ("npu", "npu")):
            if item.get_closest_marker(marker) is not None and device not in present:
                item.add_marker(pytest.mark.skip(reason=f"needs a {device} device"))
