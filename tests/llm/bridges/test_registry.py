"""Every registered family has a bridge and a tiny config; unknown names fail listing the known ones."""

from __future__ import annotations

import pytest

from mindspeed_llm.bridges import BRIDGES, FAMILIES, bridge_for_architectures, bridge_for_family
from mindspeed_llm.bridges.base import shape_fields
from mindspeed_llm.testing.tiny_models import TINY_CONFIGS


def test_every_family_has_a_bridge_and_a_tiny_config() -> None:
    assert sorted(FAMILIES) == sorted(TINY_CONFIGS), "add the missing tiny config or bridge"
    for family in FAMILIES:
        config = TINY_CONFIGS.get(family)()
        bridge = bridge_for_architectures(config.architectures)
        assert bridge.family == family, f"{config.architectures} resolves to {bridge.family}, not {family}"
        assert set(bridge.hf_architectures) <= set(BRIDGES)


def test_bridge_tables_name_real_fields() -> None:
    fields = shape_fields()
    for family in FAMILIES:
        bridge = bridge_for_family(family)
        assert {key.mg for key in bridge.config_keys} <= fields, family
        assert set(bridge.constants) <= fields, family


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError) as err:
        bridge_for_architectures(["GPTNeoXForCausalLM"])
    message = str(err.value)
    assert "GPTNeoXForCausalLM" in message
    for arch in BRIDGES:
        assert arch in message


def test_unknown_family_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama2") as err:
        bridge_for_family("llama9")
    assert "qwen3" in str(err.value)
