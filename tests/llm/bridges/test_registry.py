"""Every registered family has a bridge and a tiny config; unknown names fail listing the known ones."""

from __future__ import annotations

import pytest

from mindspeed_llm.bridges import (
    BRIDGES,
    FAMILIES,
    bridge_for_architectures,
    bridge_for_family,
    bridge_for_shape,
    families_with,
    require_capability,
)
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


def test_capabilities_say_what_the_tiny_model_is_made_of() -> None:
    # The architecture flags a bridge declares are those of its family's tiny model; every
    # refusal ("not supported yet") reads them, so they must not drift from the model.
    for family in FAMILIES:
        bridge = bridge_for_family(family)
        shape = bridge.shape_from_hf(TINY_CONFIGS.get(family)().to_dict())
        caps = bridge.capabilities
        assert caps.converts, family
        assert caps.moe == bool(shape.num_experts), family
        assert caps.shared_experts == bool(shape.moe_shared_expert_intermediate_size), family
        assert caps.mla == shape.multi_latent_attention, family
        assert caps.mtp == (bridge.mtp_config_key is not None), family
        assert bridge_for_shape(shape).family in {family, *_same_layout(family)}, family


def _same_layout(family: str) -> set[str]:
    # Families whose megatron models are identical (Mistral is Llama with a runtime window).
    return {"mistral": {"llama2"}}.get(family, set())


def test_refusals_name_the_family_and_the_supported_ones() -> None:
    unsupported = [f for f in FAMILIES if not bridge_for_family(f).capabilities.infers]
    for family in unsupported:
        with pytest.raises(ValueError) as err:
            require_capability(bridge_for_family(family), "infers")
        assert family in str(err.value) and ", ".join(families_with("infers")) in str(err.value)
    require_capability(bridge_for_family("llama2"), "trains")
    with pytest.raises(ValueError, match="unknown capability"):
        families_with("flies")


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
