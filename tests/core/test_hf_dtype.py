"""``config.json``'s dtype follows the tensors: both keys transformers reads, sub-configs, a config with neither."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindspeed.checkpointing.hf_dtype import (
    cast_floating,
    check_save_hf_dtype,
    main_dtype,
    state_dtype,
    target_dtype,
    write_config_dtype,
)


def test_write_config_dtype_rewrites_every_dtype_key(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.json"
    legacy.write_text(
        json.dumps({"torch_dtype": "bfloat16", "text_config": {"dtype": "bfloat16"}, "vision_config": {}})
    )
    write_config_dtype(legacy, torch.float32)
    assert json.loads(legacy.read_text()) == {
        "torch_dtype": "float32",
        "text_config": {"dtype": "float32"},
        "vision_config": {},
    }
    # A config that names no dtype (transformers' "auto" then reads the weights' dtype) or already
    # names the right one is left byte for byte: a round trip through Megatron stays identical.
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"model_type": "llama"}, indent=4))
    before = bare.read_bytes()
    write_config_dtype(bare, torch.bfloat16)
    assert bare.read_bytes() == before
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"dtype": "float32", "a": 1}, indent=4))
    before = same.read_bytes()
    write_config_dtype(same, torch.float32)
    assert same.read_bytes() == before
    write_config_dtype(legacy, None)  # no floating-point tensors: left as it is
    assert json.loads(legacy.read_text())["torch_dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.json", "legacy.json", "same.json"]  # no temporary left


def test_dtype_of_a_state_and_casting() -> None:
    state = {"w": torch.ones(4, 4), "b": torch.ones(2, dtype=torch.bfloat16), "ids": torch.arange(3)}
    assert state_dtype(state) == torch.float32  # the dtype holding most elements
    assert main_dtype([(torch.int64, 10)]) is None
    cast = cast_floating(state, target_dtype("bfloat16"))
    assert {k: v.dtype for k, v in cast.items()} == {"w": torch.bfloat16, "b": torch.bfloat16, "ids": torch.int64}
    assert cast_floating(state, target_dtype("auto"))["w"] is state["w"]
    with pytest.raises(ValueError, match=r"checkpoint.save_hf_dtype='bf16'.*one of \('auto', 'float32'"):
        check_save_hf_dtype("bf16")
